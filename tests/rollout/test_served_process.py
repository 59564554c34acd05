"""Stopping a served process (gspo_lab.rollout.vllm.process.stopped: the overlap engine's and the judge engine's
processes): a process stopped by SIGSTOP is continued and reads its stop request, rather than being waited on for a
minute and killed; and a judge engine that answers nothing names the key of its timeout."""

import multiprocessing
import os
import signal
import time

import pytest

from gspo_lab.rewards.judge_engine import JudgeEngine
from gspo_lab.rollout.vllm.process import stopped


def serve(requests, results) -> None:
    """Say ready, then read requests until "stop"."""
    results.put(("ready", None))
    while requests.get()[0] != "stop":
        pass


def test_a_sigstopped_process_is_continued_and_stops_when_asked():
    context = multiprocessing.get_context("spawn")
    requests, results = context.Queue(), context.Queue()
    process = context.Process(target=serve, args=(requests, results))
    process.start()
    assert results.get(timeout=60) == ("ready", None)
    os.kill(process.pid, signal.SIGSTOP)
    stopped(process, requests)
    assert process.exitcode == 0  # it read "stop" and returned; killed after the minute it would be -9


def test_a_silent_judge_engine_names_its_timeout_key():
    """The message named JudgeEngine.timeout_s, which is not a key."""
    context = multiprocessing.get_context("spawn")
    engine = JudgeEngine("judge", "float32", None, "cpu", "reward.functions.0", timeout_s=0.5)
    engine.results = context.Queue()
    engine.process = context.Process(target=time.sleep, args=(30,))
    engine.process.start()
    try:
        with pytest.raises(RuntimeError, match=r"sent nothing for 0.5 s \(reward\.functions\.0\.engine_timeout_s\)"):
            engine.answer()
    finally:
        engine.process.kill()
