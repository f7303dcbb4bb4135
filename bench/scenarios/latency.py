"""Append latency against offered load: p50, p99 and p99.9 of 64 KiB appends
to one stream, for SBP (sync always) and the peers, first with one request
in flight (each sent when the last is answered), then offered at a ladder of
fixed rates (an open loop: one request every 1/rate s, each on its own task,
answered or not, the way many independent clients load a server).

A system's ladder stops at the first rate it cannot keep up with (fewer than
``KEEP_UP`` of the offered requests answered in time) or where its p99
passes ``GIVE_UP_P99_MS``: past that point its latency is its queue.

Beside SBP's durable appends at 1 in flight, the same run measures what
stands below them: a PING round trip to the node, and 64 KiB appends to a
node run with ``--sync never`` (no durability at all), alternating with the
durable ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import trio
from matplotlib.figure import Figure

from bench.harness import Measurement, Workload, local_cluster, one_stream_64k
from bench.peers import nats_jetstream, redis_streams, sbp
from bench.report import ScenarioResult, Target, number, percent, table
from bench.scenarios.options import Options

NAME = "latency"
#: offered rates, MB/s of 64 KiB batches
RATES_MB_S = (16, 32, 64, 128, 192, 256, 320, 400, 500)
QUICK_RATES_MB_S = (32, 128)
KEEP_UP = 0.95
GIVE_UP_P99_MS = 250.0
P50_GOAL_MS = 0.5


def _rates(options: Options, batch_bytes: int) -> Iterator[float]:
    """Offered rates in requests per second."""
    for mb_per_s in QUICK_RATES_MB_S if options.quick else RATES_MB_S:
        yield mb_per_s * 1e6 / batch_bytes


def _kept_up(m: Measurement) -> bool:
    offered = m.extra.get("offered", 0)
    return offered > 0 and m.requests >= KEEP_UP * offered and m.latency_ms["p99"] < GIVE_UP_P99_MS


def _ladder(measure: Callable[[float], Measurement], rates: Iterator[float]) -> list[Measurement]:
    out = []
    for rate in rates:
        m = measure(rate)
        out.append(m)
        if not _kept_up(m):
            break
    return out


#: 1-in-flight measurements of each node (durable, and --sync never), alternating
FLOOR_ROUNDS = 3


async def _sbp(options: Options, workload: Workload) -> tuple[list[Measurement], dict[str, float]]:
    """SBP's series, and the PING round trip's percentiles."""
    async with (
        local_cluster("always", options.scratch) as cluster,
        local_cluster("never", options.scratch) as unsynced,
    ):
        closed: dict[str, list[Measurement]] = {"always": [], "never": []}
        for round_number in range(1 if options.quick else FLOOR_ROUNDS):
            order = [("always", cluster), ("never", unsynced)]
            for sync, node in order if round_number % 2 == 0 else reversed(order):
                closed[sync].append(
                    await sbp.measure_appends(node, sync, workload, options.load(1))
                )
        ping = await sbp.ping_ms(cluster, options.seconds)
        out = [_median_p50(closed["always"]), _median_p50(closed["never"])]
        for rate in _rates(options, len(workload.batch)):
            m = await sbp.measure_paced(cluster, workload, rate, options.load())
            out.append(m)
            if not _kept_up(m):
                break
        return out, ping


def _median_p50(runs: list[Measurement]) -> Measurement:
    """The run with the median p50 (the lower middle of an even count)."""
    return sorted(runs, key=lambda m: m.latency_ms["p50"])[(len(runs) - 1) // 2]


def _nats(
    options: Options, workload: Workload, flavour: nats_jetstream.Flavour
) -> list[Measurement]:
    with nats_jetstream.nats_server(options.scratch, flavour) as server:
        out = [nats_jetstream.measure_appends(server, workload, options.load(1))]
        return out + _ladder(
            lambda rate: nats_jetstream.measure_paced(server, workload, rate, options.load()),
            _rates(options, len(workload.batch)),
        )


def _redis(options: Options, workload: Workload) -> list[Measurement]:
    with redis_streams.redis_server(options.scratch) as server:
        out = [redis_streams.measure_appends(server, workload, "always", options.load(1))]
        return out + _ladder(
            lambda rate: redis_streams.measure_paced(
                server, workload, "always", rate, options.load()
            ),
            _rates(options, len(workload.batch)),
        )


def _series(m: Measurement) -> str:
    return f"{m.system} ({m.durability})"


def _closed(ms: list[Measurement], system: str, durability: str) -> Measurement:
    for m in ms:
        if (m.system, m.durability, m.in_flight) == (system, durability, 1):
            return m
    raise KeyError(f"no 1-in-flight measurement of {system} ({durability})")


def _targets(ms: list[Measurement]) -> list[Target]:
    ours = _closed(ms, sbp.SYSTEM, sbp.durability_label("always"))
    nats = _closed(ms, nats_jetstream.SYSTEM, nats_jetstream.SYNC_ALWAYS.durability)
    return [
        Target(
            "durable 64 KiB append at 1 in flight: SBP p50",
            ours.latency_ms["p50"],
            P50_GOAL_MS,
            "ms",
            higher_is_better=False,
        ),
        Target(
            "p50 at 1 in flight: SBP / NATS 2.15 (sync always)",
            ours.latency_ms["p50"] / nats.latency_ms["p50"],
            1.0,
            "x",
            higher_is_better=False,
            note=f"{ours.latency_ms['p50']:.2f} vs {nats.latency_ms['p50']:.2f} ms",
        ),
    ]


def _floor_table(ms: list[Measurement], ping: dict[str, float]) -> str:
    """What a durable append's p50 at 1 in flight stands on, in this run."""
    durable = _closed(ms, sbp.SYSTEM, sbp.durability_label("always"))
    unsynced = _closed(ms, sbp.SYSTEM, sbp.durability_label("never"))
    nats = _closed(ms, nats_jetstream.SYSTEM, nats_jetstream.SYNC_ALWAYS.durability)
    rows = [
        ("PING round trip (client and node in Python, no payload, no storage)", ping["p50"]),
        (
            "64 KiB APPEND to a node run with --sync never (no durability)",
            unsynced.latency_ms["p50"],
        ),
        ("64 KiB APPEND, sync always", durable.latency_ms["p50"]),
        ("NATS JetStream 2.15, sync always", nats.latency_ms["p50"]),
    ]
    return (
        "## What a durable append at 1 in flight stands on (p50)\n\n"
        f"Target: {P50_GOAL_MS} ms. SBP's rows are the median of {FLOOR_ROUNDS} alternating "
        "runs of each node (one in a quick run).\n\n"
        + table(["request", "p50 ms"], [(name, number(p50, 2)) for name, p50 in rows], "lr")
    )


def _tables(ms: list[Measurement]) -> list[str]:
    rows = [
        (
            _series(m),
            "1 in flight" if m.in_flight == 1 else number(m.extra["offered_mb_per_s"]),
            number(m.mb_per_s),
            f"{m.extra.get('refused', 0):,}",
            percent(m.server_cpu),
            percent(m.client_cpu),
            *(
                number(m.latency_ms[key], 2) if m.requests else "none answered"
                for key in ("p50", "p99", "p99.9", "max")
            ),
        )
        for m in ms
    ]
    return [
        "## Latency against offered load (64 KiB batches, one stream)\n\n"
        "Offered: MB/s sent on a fixed schedule, in rising steps, stopped at the first "
        f"rate a system could not keep up with: under {KEEP_UP:.0%} answered, or p99 over "
        f"{GIVE_UP_P99_MS:.0f} ms). Refused: requests the server turned away (JetStream "
        "answers 429 when too many publishes wait). Latency from sending a request to its "
        "acknowledgement. "
        "CPU: 100 % = one core; the client is this benchmark process.\n\n"
        + table(
            [
                "system",
                "offered MB/s",
                "answered MB/s",
                "refused",
                "server CPU",
                "client CPU",
                "p50 ms",
                "p99 ms",
                "p99.9 ms",
                "max ms",
            ],
            rows,
            "l" + "r" * 9,
        )
    ]


def _plot(ms: list[Measurement]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        axes = figure.subplots(1, 3, sharey=True)
        for name in sorted({_series(m) for m in ms}):
            points = sorted(
                (m.extra["offered_mb_per_s"], m.latency_ms)
                for m in ms
                if _series(m) == name and m.in_flight == 0
            )
            if not points:
                continue
            rates = [rate for rate, _ in points]
            for ax, key in zip(axes, ("p50", "p99", "p99.9"), strict=True):
                ax.plot(rates, [latency[key] for _, latency in points], marker="o", label=name)
        for ax, key in zip(axes, ("p50", "p99", "p99.9"), strict=True):
            ax.set_yscale("log")
            ax.set_xlabel("offered MB/s")
            ax.set_title(f"{key} latency")
        axes[0].set_ylabel("ms, send to acknowledgement")
        axes[0].legend(fontsize=7)

    return draw


def run(options: Options) -> ScenarioResult:
    workload = one_stream_64k()
    measurements, ping = trio.run(_sbp, options, workload)
    for flavour in (nats_jetstream.SYNC_ALWAYS, nats_jetstream.TIMER_2_15):
        measurements += _nats(options, workload, flavour)
    measurements += _redis(options, workload)
    return ScenarioResult(
        name=NAME,
        title="Append latency against offered load",
        settings=options.as_settings()
        | {
            "batch_bytes": len(workload.batch),
            "rates_mb_per_s": list(QUICK_RATES_MB_S if options.quick else RATES_MB_S),
            "keep_up": KEEP_UP,
            "give_up_p99_ms": GIVE_UP_P99_MS,
        },
        measurements=measurements,
        targets=_targets(measurements),
        tables=[_floor_table(measurements, ping), *_tables(measurements)],
        plot=_plot(measurements),
        extra={"ping_ms": ping},
    )
