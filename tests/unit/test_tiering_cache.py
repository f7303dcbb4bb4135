"""The bounded disk cache of object chunks (``--object-cache-bytes``)."""

from __future__ import annotations

from pathlib import Path

from tiering.cache import ChunkCache


def test_the_cache_never_holds_more_than_its_bound(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=1000)
    for chunk in range(10):
        cache.put("a", chunk, bytes([chunk]) * 300)
        assert cache.bytes <= 1000
        on_disk = sum(p.stat().st_size for p in (tmp_path / "cache").iterdir())
        assert on_disk == cache.bytes
    assert len(cache) == 3
    assert cache.get("a", 9) == bytes([9]) * 300
    assert cache.get("a", 0) is None  # evicted, oldest first


def test_the_least_recently_read_chunk_goes_first(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=900)
    for chunk in range(3):
        cache.put("a", chunk, b"x" * 300)
    assert cache.get("a", 0) is not None  # read: now the most recent
    cache.put("a", 3, b"y" * 300)
    assert ("a", 0) in cache and ("a", 1) not in cache
    assert (cache.hits, cache.misses) == (1, 0)


def test_a_chunk_larger_than_the_bound_is_not_kept(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=100)
    cache.put("a", 0, b"x" * 101)
    assert len(cache) == 0 and cache.bytes == 0
    assert cache.get("a", 0) is None and cache.misses == 1


def test_a_deleted_object_leaves_the_cache(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=10_000)
    cache.put("a", 0, b"x" * 10)
    cache.put("a", 1, b"x" * 10)
    cache.put("b", 0, b"y" * 10)
    cache.forget_object("a")
    assert len(cache) == 1 and cache.bytes == 10
    assert cache.get("b", 0) == b"y" * 10


def test_a_restarted_cache_starts_empty(tmp_path: Path) -> None:
    first = ChunkCache(tmp_path / "cache", max_bytes=1000)
    first.put("a", 0, b"x" * 10)
    again = ChunkCache(tmp_path / "cache", max_bytes=1000)
    assert len(again) == 0 and not any((tmp_path / "cache").iterdir())
