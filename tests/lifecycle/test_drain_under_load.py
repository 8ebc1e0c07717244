"""SIGTERM with 32 streams in flight, on a real server process: the short streams finish, the long ones end with
finish_reason "abort" in a final SSE chunk (and [DONE]), new requests get 503, the process exits 0 within the drain
timeout plus 2 s, and a real OTLP receiver gets the drain span with the counts."""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path

import httpx
from lifecycle_harness import ProcessServer, wait_ready
from otlp_receiver import OtlpHttpReceiver
from test_signals import StreamReader

from glowplug.profiling.names import DRAIN_SPAN, DrainAttr

STREAMS = 32
DRAIN_S = 10.0
# The short streams must still be running when the last stream has started, and done well within the drain timeout.
# A fixed count did not hold on every machine (on a faster CPU 12 of 16 ended before the signal), so it is sized from
# the per-stream rate measured with 32 streams running: SHORT_S seconds of tokens at that rate, well above the spread
# of the short streams' starts (under a second) and well inside DRAIN_S.
SHORT_S = 3.0
MIN_SHORT_TOKENS = 48
CALIBRATE = 64
LONG_TOKENS = 8000  # cannot, on any machine: 8000 steps of a batch of 16+ in 10 s would be 1.25 ms a step


def test_sigterm_with_32_streams_in_flight(long_model: Path, tmp_path: Path) -> None:
    with OtlpHttpReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.traces_endpoint}
        # KV room for every stream's progress during the drain: no preemption slows the short ones down.
        args = ["--drain-timeout", str(DRAIN_S), "--max-num-seqs", "64", "--num-gpu-blocks-override", "8192"]
        srv = ProcessServer(long_model, tmp_path / "server.log", env=env, args=args)
        try:
            wait_ready(srv.base_url, timeout=300)

            def reader(i: int, max_tokens: int) -> StreamReader:
                body = {
                    "prompt": f"stream {i}",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                return StreamReader(srv.base_url, body)

            long_readers = [reader(i, LONG_TOKENS) for i in range(0, STREAMS, 2)]
            for r in long_readers:
                r.start()
            for r in long_readers:
                assert r.first.wait(60) and r.error is None
            # Tokens per second of one stream with 32 running, as during the drain: 16 probe streams of CALIBRATE
            # tokens beside the long ones, each timed from its request to its last chunk. (Measured with 16 streams
            # instead, the rate at 32 was from 1.6x to 4x lower, and short streams sized from it were aborted.)
            probes = [reader(100 + i, CALIBRATE) for i in range(STREAMS // 2)]
            sent_ns = time.time_ns()
            for r in probes:
                r.start()
            for r in probes:
                r.join(60)
                assert r.error is None and r.tokens() == CALIBRATE, r.error
            rate = statistics.median(r.tokens() / ((r.last_chunk_ns - sent_ns) / 1e9) for r in probes)
            short_tokens = max(MIN_SHORT_TOKENS, round(rate * SHORT_S))
            short_readers = [reader(i, short_tokens) for i in range(1, STREAMS, 2)]
            readers = long_readers + short_readers
            for r in short_readers:
                r.start()
            for r in short_readers:
                assert r.first.wait(60) and r.error is None  # admitted and generating: in flight
            in_flight = [r for r in readers if r.is_alive()]
            assert len(in_flight) == STREAMS, f"a short stream ended before the signal; make SHORT_S longer ({rate=})"
            srv.signal(signal.SIGTERM)
            signalled = time.monotonic()

            statuses: list[int] = []
            with httpx.Client(base_url=srv.base_url, timeout=5.0) as http:
                deadline = time.monotonic() + DRAIN_S / 2
                while time.monotonic() < deadline:
                    try:
                        statuses.append(
                            http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2}).status_code
                        )
                    except httpx.TransportError:
                        break
                    time.sleep(0.05)
            assert statuses and set(statuses[-3:]) == {503}, statuses

            code = srv.wait(DRAIN_S + 30)
            exited_after = time.monotonic() - signalled
            assert code == 0, srv.output()[-3000:]
            assert exited_after <= DRAIN_S + 2.0, f"exit {exited_after:.2f} s after SIGTERM"
            for r in readers:
                r.join(10)
                assert r.error is None, r.error
                assert r.done_marker, "every stream ends with [DONE]"
                reasons = r.finish_reasons()
                assert len(reasons) == 1, reasons  # one final chunk per stream
            got = [(r.finish_reasons(), r.tokens()) for r in short_readers]
            assert all(g == (["length"], short_tokens) for g in got), (short_tokens, rate, got)
            aborted = [r for r in long_readers if r.finish_reasons() == ["abort"]]
            assert aborted, "no long stream was aborted: the drain timeout did not bite"
            assert all(r.tokens() < LONG_TOKENS for r in aborted)
            assert all(r.finish_reasons() in (["length"], ["abort"]) for r in long_readers)

            spans = rx.wait_for_spans(1, timeout_s=10)
            drains = [s for s in spans if s.name == DRAIN_SPAN]
            assert len(drains) == 1, [s.name for s in spans]
            attrs = drains[0].attributes
            # A short stream may end between the alive check and the signal landing, so the count taken before the
            # signal is an upper bound; streams whose final chunk arrived after the drain span began were certainly
            # in flight when it began (one chunk per stream may still be on the wire: a tolerance of 2).
            still_running = [r for r in readers if r.last_chunk_ns > drains[0].start_ns]
            assert len(still_running) - 2 <= attrs[DrainAttr.IN_FLIGHT] <= len(in_flight)
            assert len(still_running) >= len(aborted)
            assert attrs[DrainAttr.ABORTED] == len(aborted)
            assert attrs[DrainAttr.FINISHED] + attrs[DrainAttr.ABORTED] == attrs[DrainAttr.IN_FLIGHT]
            assert attrs[DrainAttr.CLEAN] is False and attrs[DrainAttr.TIMEOUT_S] == DRAIN_S
            # The figures behind the issue note (shown with `pytest -s`).
            print(
                f"SIGTERM with {len(in_flight)} streams in flight: drain span in_flight={attrs[DrainAttr.IN_FLIGHT]} "
                f"finished={attrs[DrainAttr.FINISHED]} (short streams of {short_tokens} tokens at {rate:.0f} tok/s) "
                f"aborted={attrs[DrainAttr.ABORTED]}; {len(statuses)} late "
                f"requests, last status {statuses[-1]}; exit {code} {exited_after:.2f} s after the signal "
                f"(limit {DRAIN_S + 2.0:g} s)"
            )
        finally:
            srv.kill()
