"""TokenFeed: tokens put from another thread reach the reader on the event loop, those that
came while it was away in one take, and a failure only after every token put before it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cloud.token_feed import FeedHub
from shared.errors import VerifierFault


def _from_thread(fn: object) -> None:
    thread = threading.Thread(target=fn)  # type: ignore[arg-type]
    thread.start()
    thread.join()


def test_tokens_put_while_the_reader_was_away_come_in_one_take() -> None:
    async def run() -> None:
        feed = FeedHub(asyncio.get_running_loop()).feed()

        def engine() -> None:
            feed.put([1], 2.0)
            feed.put([], 9.0)  # a step that gave this stream nothing
            feed.put([2, 3], 3.0)

        _from_thread(engine)
        assert await asyncio.wait_for(feed.take(), 5) == ([1, 2, 3], 3.0)
        _from_thread(lambda: feed.put([4], 1.5))
        assert await asyncio.wait_for(feed.take(), 5) == ([4], 1.5)

    asyncio.run(run())


def test_a_reader_waits_for_the_next_step_and_is_woken_by_it() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        feed = FeedHub(loop).feed()
        waiting = asyncio.ensure_future(feed.take())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        loop.call_later(0.05, lambda: threading.Thread(target=lambda: feed.put([7], 1.0)).start())
        assert await asyncio.wait_for(waiting, 5) == ([7], 1.0)

    asyncio.run(run())


def test_a_failure_comes_after_the_tokens_put_before_it() -> None:
    async def run() -> None:
        feed = FeedHub(asyncio.get_running_loop()).feed()

        def engine() -> None:
            feed.put([5, 6], 1.0)
            feed.fail(VerifierFault("the request ended"))
            feed.fail(VerifierFault("a second reason is not kept"))

        _from_thread(engine)
        assert await asyncio.wait_for(feed.take(), 5) == ([5, 6], 1.0)
        with pytest.raises(VerifierFault, match="the request ended"):
            await asyncio.wait_for(feed.take(), 5)

    asyncio.run(run())


def test_many_feeds_written_in_one_step_wake_the_loop_once() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        hub = FeedHub(loop)
        feeds = [hub.feed() for _ in range(64)]
        wakeups = 0
        deliver = hub._deliver

        def counted() -> None:
            nonlocal wakeups
            wakeups += 1
            deliver()

        hub._deliver = counted  # type: ignore[method-assign]
        _from_thread(lambda: [feed.put([i], 1.0) for i, feed in enumerate(feeds)])
        got = await asyncio.gather(*(asyncio.wait_for(feed.take(), 5) for feed in feeds))
        assert [tokens for tokens, _ in got] == [[i] for i in range(64)]
        assert wakeups == 1

    asyncio.run(run())
