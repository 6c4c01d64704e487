"""The transport's floor under a served round: a real gRPC echo in another process."""

from __future__ import annotations

import asyncio
import multiprocessing

from bench import grpc_echo


def test_the_echo_times_each_message_there_and_back_and_its_server_process_goes() -> None:
    back_to_back = asyncio.run(asyncio.wait_for(grpc_echo.round_trip_ms(0.0, messages=8, skip=2), timeout=60))
    paused = asyncio.run(asyncio.wait_for(grpc_echo.round_trip_ms(0.02, messages=8, skip=2), timeout=60))
    assert 0.0 < back_to_back < 1000.0 and 0.0 < paused < 1000.0
    assert not [p for p in multiprocessing.active_children() if p.name == "grpc-echo"]
