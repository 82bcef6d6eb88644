"""When an average is captured in a CUDA graph (the bookkeeping; the graphs themselves run in the
NCCL tests of test_ddp_quantized_hooks.py and the averaging scenarios of the integration suite)."""

import subprocess
import sys

from dcomm.core import captured_average as captured
from dcomm.core.captured_average import CAPTURE_AFTER, MAX_GRAPHS, CapturedAverages


def _output_of(script: str) -> str:
    """What ``script`` prints in a new interpreter (its stderr too: the assertion shows it)."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout + done.stderr


def test_a_key_is_due_after_its_eager_calls_and_never_again_once_captured() -> None:
    graphs = CapturedAverages("test")
    assert [graphs.due("bucket 0") for _ in range(CAPTURE_AFTER + 1)] == [False] * CAPTURE_AFTER + [True]
    assert graphs.due("bucket 1") is False  # counted per key
    graphs._captured["bucket 0"] = object()  # as capture() records it
    assert graphs.due("bucket 0") is False
    assert len(graphs) == 1
    graphs.clear()  # a restore replaced the memories: captured again when due
    assert len(graphs) == 0
    assert [graphs.due("bucket 0") for _ in range(CAPTURE_AFTER + 1)][-1] is True


def test_graphs_turned_off_are_never_due() -> None:
    graphs = CapturedAverages("test")
    graphs.enabled = False
    assert not any(graphs.due("bucket") for _ in range(CAPTURE_AFTER + 3))


def test_keys_that_never_repeat_stay_bounded() -> None:
    graphs = CapturedAverages("test")
    for call in range(5 * MAX_GRAPHS):  # a fresh tensor address every call (DDP's join shadows)
        assert graphs.due(("int8", 0, 1024, call)) is False
    assert len(graphs._eager_calls) <= 4 * MAX_GRAPHS
    for key in range(MAX_GRAPHS):
        graphs._captured[key] = object()
    assert [graphs.due("new") for _ in range(CAPTURE_AFTER + 1)] == [False] * (CAPTURE_AFTER + 1)


def test_replay_without_a_graph_asks_for_the_eager_path() -> None:
    assert CapturedAverages("test").replay("bucket", stream=None) is None
    assert CapturedAverages("test").replay("bucket", stream=None, watched=True) is None


def test_the_watched_bucket_runs_eagerly_every_so_often_for_the_watchdog() -> None:
    graphs = CapturedAverages("test")
    every = captured.WATCHED_EVERY
    assert every > CAPTURE_AFTER
    assert [graphs.eager_turn(watched=True) for _ in range(2 * every)] == ([False] * (every - 1) + [True]) * 2
    assert not any(graphs.eager_turn(watched=False) for _ in range(3 * every))


def test_a_forgotten_key_is_counted_again_and_the_bound_is_per_owner() -> None:
    graphs = CapturedAverages("test", max_graphs=1)
    assert [graphs.due("params") for _ in range(CAPTURE_AFTER + 1)][-1] is True
    graphs._captured["params"] = object()
    assert [graphs.due("other") for _ in range(CAPTURE_AFTER + 1)][-1] is False  # one graph at most
    graphs.forget("params")  # the parameters moved: its graph and count are gone
    assert len(graphs) == 0
    assert [graphs.due("params") for _ in range(CAPTURE_AFTER + 1)] == [False] * CAPTURE_AFTER + [True]
    graphs.forget("never captured")  # nothing to forget: no error


def test_the_switch_turns_capture_and_replay_off(monkeypatch) -> None:
    graphs = CapturedAverages("test")
    graphs._captured["params"] = object()  # as if captured: replay would run it
    monkeypatch.setenv(captured.SWITCH, "0")
    assert graphs.replay("params", stream=None, watched=True) is None
    assert not any(graphs.due("other") for _ in range(CAPTURE_AFTER + 3))
    monkeypatch.setenv(captured.SWITCH, "1")
    assert [graphs.due("other") for _ in range(CAPTURE_AFTER + 1)][-1] is True


def test_release_all_clears_every_owner_and_runs_at_exit() -> None:
    first, second = CapturedAverages("one"), CapturedAverages("two")
    first._captured["a"] = object()
    second._captured["b"] = object()
    captured.release_all()
    assert len(first) == len(second) == 0
    # At exit: a handler registered before the module sees the graphs already released
    # (atexit runs handlers last-registered first), so none is alive at interpreter teardown.
    script = (
        "import atexit\n"
        "live = {}\n"
        "atexit.register(lambda: print('graphs at exit:', len(live['graphs'])))\n"
        "from dcomm.core.captured_average import CapturedAverages\n"
        "live['graphs'] = CapturedAverages('exit')\n"
        "live['graphs']._captured['key'] = object()\n"
    )
    assert "graphs at exit: 0" in _output_of(script)


def test_destroy_process_group_releases_the_graphs_first_however_it_was_imported() -> None:
    # A live graph holding NCCL collectives hangs destroy_process_group: every process group's
    # shutdown releases the graphs before torch's runs, also through a destroy_process_group
    # imported before dcomm (the DDP tutorial's form), for a subgroup and for the world (here
    # with gloo and stand-in graphs).
    script = (
        "import os, tempfile\n"
        "from torch.distributed import destroy_process_group, init_process_group, new_group\n"
        "from dcomm.core.captured_average import CapturedAverages\n"
        "graphs = CapturedAverages('destroy')\n"
        "store = os.path.join(tempfile.mkdtemp(), 'store')\n"
        "init_process_group('gloo', init_method='file://' + store, rank=0, world_size=1)\n"
        "subgroup = new_group([0])\n"
        "graphs._captured['key'] = object()\n"
        "destroy_process_group(subgroup)\n"
        "print('graphs after the subgroup:', len(graphs))\n"
        "graphs._captured['key'] = object()\n"
        "destroy_process_group()\n"
        "print('graphs after the world:', len(graphs))\n"
    )
    output = _output_of(script)
    assert "graphs after the subgroup: 0" in output
    assert "graphs after the world: 0" in output
