"""measure.HostCounters on this (Linux) machine: what it reads around a step is real and attributed."""
import gc
import time

import pytest

torch = pytest.importorskip("torch")

from validate import measure  # noqa: E402


def test_a_collection_inside_the_step_is_counted_and_one_outside_is_not():
    host = measure.HostCounters(torch.device("cpu"))
    gc.disable()                           # only the explicit collections below
    try:
        gc.collect()                       # before start: not this step's
        host.start()
        junk = [[i] for i in range(200_000)]
        t0 = time.perf_counter()
        gc.collect()
        collect_s = time.perf_counter() - t0
        del junk
        step = host.stop()
        gc.collect()                       # after stop: not this step's either
    finally:
        host.close()
        gc.enable()
    assert 0.5 * collect_s < step["gc_s"] <= collect_s   # the callbacks run inside gc.collect()
    assert step["runq_s"] is not None and step["runq_s"] >= 0
    assert step["steal_s"] is not None and step["steal_s"] >= 0
    assert step["sm_mhz"] is None          # no GPU clock off CUDA
    assert host._gc not in gc.callbacks    # closed: later jobs' collections are not timed


def test_time_waiting_for_a_cpu_is_seen_when_two_threads_share_one_core():
    import os
    import threading
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})   # this thread and the spinner on one CPU
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass
    try:
        spinner = threading.Thread(target=spin)   # inherits the one-CPU mask
        spinner.start()
        host = measure.HostCounters(torch.device("cpu"))
        host.start()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:     # runnable the whole time, sharing the core
            sum(range(1000))
        step = host.stop()
        host.close()
    finally:
        stop.set()
        spinner.join()
        os.sched_setaffinity(0, before)
    assert step["runq_s"] > 0.03   # the spinner held the core for part of the 0.3 s


def test_the_python_probe_slows_when_another_thread_takes_the_interpreter():
    """measure.host_python_s times Python that issues nothing. With a second thread spinning in Python
    and the interpreter switching every 0.1 ms, the probe's thread holds the GIL about half the time,
    so a call should take about twice as long; the probe must see at least 1.4x. The spinner is
    waited for until it spins, and the comparison gets three tries: on a busy 2-core machine the
    operating system can leave the spinner off a CPU for a whole probe."""
    import statistics
    import sys
    import threading

    def probe():
        return statistics.median(measure.host_python_s() for _ in range(5))

    def spin(spinning, stop):
        n = 0
        while not stop.is_set():
            n += 1
            spinning.set()

    interval = sys.getswitchinterval()
    ratios = []
    for _ in range(3):
        alone_s = probe()
        assert 0 < alone_s < 1e-4          # a call is well under 100 us on any machine
        spinning, stop = threading.Event(), threading.Event()
        sys.setswitchinterval(1e-4)
        other = threading.Thread(target=spin, args=(spinning, stop))
        other.start()
        try:
            spinning.wait(5)
            ratios.append(probe() / alone_s)
        finally:
            stop.set()
            other.join()
            sys.setswitchinterval(interval)
        if ratios[-1] > 1.4:
            break
    assert max(ratios) > 1.4, ratios


def test_the_main_thread_runs_alone_on_its_core_and_the_masks_come_back():
    """measure.main_thread_alone pins the calling thread to one CPU and keeps the process's other
    threads (here one started before) off it; on exit both masks are what they were."""
    import os
    import threading
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs CPU affinity and two CPUs")
    started, stop, seen = threading.Event(), threading.Event(), {}

    def other():
        seen["tid"] = threading.get_native_id()
        started.set()
        stop.wait()

    t = threading.Thread(target=other)
    t.start()
    started.wait()
    before_main, before_other = os.sched_getaffinity(0), os.sched_getaffinity(seen["tid"])
    try:
        with measure.main_thread_alone() as cpu:
            assert os.sched_getaffinity(0) == {cpu}
            assert cpu == max(before_main)
            assert cpu not in os.sched_getaffinity(seen["tid"])
            assert os.sched_getaffinity(seen["tid"])           # never left with no CPU
        assert os.sched_getaffinity(0) == before_main
        assert os.sched_getaffinity(seen["tid"]) == before_other
    finally:
        stop.set()
        t.join()
