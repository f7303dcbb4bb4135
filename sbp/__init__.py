"""The Streaming Batch Protocol (SBP): wire constants, frames, typed headers,
record batches and per-connection state. No I/O happens in this package."""
