"""The whole step's CUDA graphs (`vox_ws/engines/voxcpm/cuda_graphs.py`), driven on the CPU through
the capture seam: a fake capture that records where it ran and replays by running the step again
on the same static inputs, as a graph replays its kernels on them. What the fake cannot show (a
real capture and replay) the device check runs on a GPU."""

from __future__ import annotations

import contextlib
import logging
import threading
import types

import numpy as np
import pytest
import torch

from conftest import eager_speech, speak_rows, tiny_runner
from vox_ws.engines import accelerator
from vox_ws.engines.voxcpm.cuda_graphs import CapturedSteps, CudaCapture, length_buckets
from vox_ws.engines.voxcpm.graph_check import agreeing_whole_steps
from vox_ws.engines.voxcpm.prompt import build_prompt
from vox_ws.engines.voxcpm.runner import PrefillInput
from vox_ws.engines.voxcpm.whole_step import StepInputs, step_function


class RecordingLock:
    """A lock that knows whether it is held, and by which thread."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.holder: int | None = None

    def __enter__(self) -> None:
        self._lock.__enter__()
        self.holder = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self.holder = None
        self._lock.__exit__(*exc)


class FakeCapture:
    """Records, for each capture, the thread, whether the lock was held and the device context
    it ran in; replays by running again. `fail_for`: the buckets whose capture raises."""

    def __init__(self, lock: RecordingLock, fail_for: tuple[int, ...] = ()) -> None:
        self.lock = lock
        self.fail_for = fail_for
        self.device: str | None = None
        self.captures: list[dict] = []

    def exclusive(self, device: str):
        """`accelerator.exclusive_on` as the capture sees it: the lock held, the device current."""
        fake = self

        class Entered:
            def __enter__(self) -> None:
                fake.lock.__enter__()
                fake.device = device

            def __exit__(self, *exc: object) -> None:
                fake.device = None
                fake.lock.__exit__(*exc)
        return Entered()

    def __call__(self, run):
        outputs = run()
        rows = outputs[0].shape[0]
        self.captures.append({"thread": threading.get_ident(), "locked": self.lock.holder == threading.get_ident(),
                              "device": self.device, "rows": rows})
        if rows in self.fail_for:
            raise RuntimeError("operation not permitted when stream is capturing")
        return run


class EagerWhole:
    """The whole step uncompiled (`step_function` as it is), standing in for `WholeSteps`: the
    same code the graphs are compiled from, ready for `buckets`."""

    def __init__(self, model, buckets: tuple[int, ...], in_place: bool = False, decoder=None) -> None:
        self.model, self.decoder = model, decoder
        self.buckets = buckets
        self.in_place = in_place
        self.ready = {(bucket, 10, decode) for bucket in buckets for decode in (False, True)}
        self.calls = 0

    def serves(self, bucket: int, timesteps: int, decode: bool) -> bool:
        return (bucket, timesteps, decode) in self.ready

    def __call__(self, timesteps: int, decode: bool, given: StepInputs):
        self.calls += 1
        return step_function(timesteps, decode, self.in_place)(self.model, *given)


class WrongWhole(EagerWhole):
    """A whole step whose audio is off by a little: what a miscompiled graph would speak."""

    def __call__(self, timesteps: int, decode: bool, given: StepInputs):
        out = super().__call__(timesteps, decode, given)
        return (*out[:-1], out[-1] + 0.05)


def _step_inputs(bucket: int, length: int) -> StepInputs:
    return StepInputs(None, [], [], torch.zeros(bucket, 3, dtype=torch.long), torch.arange(length))


def test_captures_run_on_the_engine_thread_under_the_lock_and_the_device_context_largest_first():
    lock = RecordingLock()
    fake = FakeCapture(lock)
    steps = CapturedSteps(lambda timesteps, decode, given: (given.rows, given.keys_at), torch.device("cpu"),
                          fake, owner=threading.get_ident(), exclusive=fake.exclusive)
    steps.capture_all(_step_inputs, buckets=(1, 4, 2), lengths=(256, 512), decode=True)
    assert [c["rows"] for c in fake.captures] == [4, 4, 2, 2, 1, 1]
    assert all(c["locked"] and c["device"] == "cpu" and c["thread"] == threading.get_ident() for c in fake.captures)
    assert set(steps.captured_s) == {f"{b}x{n}x10" for b in (1, 2, 4) for n in (256, 512)}

    # Replayed from the smallest length that holds the step, its static rows refilled.
    rows = torch.tensor([[3, 300, 7], [2, 100, 9]])
    static, out_rows, keys_at = steps.replay(2, 301, 10, True, rows)
    assert torch.equal(static, rows) and keys_at.shape[0] == 512
    assert steps.replay(2, 513, 10, True, rows) is None          # past every length: not captured
    assert steps.replay(8, 10, 10, True, rows) is None           # a bucket not captured
    assert steps.replay(2, 10, 6, True, rows) is None            # timesteps not captured
    assert steps.replay(2, 10, 10, False, rows) is None          # nor the step without its decode


def test_another_thread_may_not_capture():
    lock = RecordingLock()
    fake = FakeCapture(lock)
    steps = CapturedSteps(lambda *args: (torch.zeros(1),), torch.device("cpu"), fake, owner=threading.get_ident(),
                          exclusive=fake.exclusive)
    failures = []

    def capture() -> None:
        try:
            steps.capture_all(_step_inputs, buckets=(1,), lengths=(256,), decode=True)
        except RuntimeError as exc:
            failures.append(str(exc))

    other = threading.Thread(target=capture)
    other.start()
    other.join()
    assert failures and "engine's own thread" in failures[0]
    assert fake.captures == []


def test_a_failed_capture_leaves_its_bucket_uncaptured_with_a_log_line(caplog):
    lock = RecordingLock()
    fake = FakeCapture(lock, fail_for=(2,))
    steps = CapturedSteps(lambda timesteps, decode, given: (given.rows,), torch.device("cpu"), fake,
                          owner=threading.get_ident(), exclusive=fake.exclusive)
    with caplog.at_level(logging.WARNING, logger="vox_ws.engines.voxcpm"):
        steps.capture_all(_step_inputs, buckets=(1, 2, 4), lengths=(256,), decode=True)
    assert set(steps.failed) == {"2x256x10"} and "not permitted" in steps.failed["2x256x10"]
    assert any("not captured" in r.getMessage() and "uncaptured" in r.getMessage() for r in caplog.records)
    rows = torch.zeros(2, 3, dtype=torch.long)
    assert steps.replay(2, 10, 10, True, rows) is None
    assert steps.replay(4, 10, 10, True, torch.zeros(4, 3, dtype=torch.long)) is not None


def test_the_process_wide_lock_is_the_one_voices_take():
    assert CapturedSteps.__init__.__defaults__[0] is accelerator.exclusive_on
    entered = []
    with accelerator.exclusive_on("cpu"):
        entered.append(accelerator.DEVICE_LOCK._is_owned())
    assert entered == [True]


def test_attention_lengths_double_up_to_the_models_positions():
    assert length_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert length_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert length_buckets(100) == (100,)


@pytest.mark.parametrize("decode_process,in_place", [(False, False), (False, True),
                                                     pytest.param(True, False, marks=pytest.mark.slow)])
def test_a_runner_replaying_captured_whole_steps_speaks_as_the_eager_runner(tiny_model, decode_process, in_place):
    """Three rows in a bucket of four (one padding row in the padding slot), attending over a
    length bucket longer than their positions (masked), their inputs copied into the static
    rows at each replay: the audio of the eager step. Attending in place, one capture serves
    every length."""
    torch.set_num_threads(1)
    texts = ["One sentence here.", "Another, a bit longer sentence.", "Third."]
    want = eager_speech(tiny_model, texts, 4, decode_process)
    runner = tiny_runner(tiny_model, 4, decode_process)
    try:
        runner.whole = EagerWhole(runner.model, (4,), in_place)
        lock = RecordingLock()
        fake = FakeCapture(lock)
        runner.captured = CapturedSteps(runner.whole, runner.device, fake, owner=threading.get_ident(),
                                        exclusive=fake.exclusive)
        runner.capture_whole(fake, buckets=(4,))
        captured = len(fake.captures)
        assert captured == (1 if in_place else len(length_buckets(runner.max_len)))
        assert all(c["locked"] for c in fake.captures)
        calls = runner.whole.calls
        got = speak_rows(runner, texts)
        assert runner.whole.calls > calls, "the steps must have been replayed"
    finally:
        runner.close()
    for a, b in zip(want, got):
        assert a.shape == b.shape and np.max(np.abs(a - b)) < 1e-5


def test_a_whole_step_that_differs_from_the_uncompiled_one_is_never_run_nor_captured(tiny_model, caplog):
    """Each bucket of the whole step is compared with the uncompiled whole step (attending
    through the gather) on copies of its own before anything is captured: one attending in place
    agrees; one whose audio is off stays out of the ready buckets, named with why, and is never
    captured, while the others are."""
    torch.set_num_threads(1)
    runner = tiny_runner(tiny_model, 4)
    try:
        row = runner.prefill(PrefillInput(build_prompt(runner.model, "Held.", None), seed=0, cfg_value=2.0,
                                          timesteps=10, min_len=2, max_len=8))
        held = [t[row.slot].clone() for t in runner._caches + runner._buffers]
        in_place = EagerWhole(runner.model, (1, 2, 4), in_place=True, decoder=runner.vae)
        mismatched: dict = {}
        agreeing_whole_steps(in_place, EagerWhole(runner.model, (1, 2, 4)), runner.serving_state(free=True),
                             (1, 2, 4), True, mismatched)
        assert mismatched == {} and all(in_place.serves(b, 10, True) for b in (1, 2, 4))

        wrong = WrongWhole(runner.model, (1, 2, 4), decoder=runner.vae)
        with caplog.at_level(logging.ERROR, logger="vox_ws.engines.voxcpm"):
            agreeing_whole_steps(wrong, EagerWhole(runner.model, (1, 2, 4)), runner.serving_state(free=True), (2,),
                                 True, mismatched)
        assert set(mismatched) == {"whole 2"} and "audio" in mismatched["whole 2"]
        assert not wrong.serves(2, 10, True) and wrong.serves(4, 10, True)
        assert any("whole step for 2 rows is not used" in r.getMessage() for r in caplog.records)
        # Compared on the serving's caches, in the slots no request holds: a request's is untouched.
        assert all(torch.equal(t[row.slot], before) for t, before in zip(runner._caches + runner._buffers, held))
        runner.release(row)

        runner.whole = wrong
        lock = RecordingLock()
        fake = FakeCapture(lock)
        runner.captured = CapturedSteps(runner.whole, runner.device, fake, owner=threading.get_ident(),
                                        exclusive=fake.exclusive)
        runner.capture_whole(fake)
        assert {c["rows"] for c in fake.captures} == {1, 4}
    finally:
        runner.close()



class OffReplay(FakeCapture):
    """A capture whose replay of `bucket` rows speaks a little off (what a graph captured with a
    wrong kernel or a stale input would replay); the others replay the step."""

    def __init__(self, lock: RecordingLock, bucket: int) -> None:
        super().__init__(lock)
        self.bucket = bucket

    def __call__(self, run):
        replay = super().__call__(run)
        if run()[0].shape[0] != self.bucket:
            return replay
        return lambda: (lambda out: (*out[:-1], out[-1] + 0.05))(replay())


def test_a_captured_graph_is_compared_with_eager_before_it_serves(tiny_model, caplog):
    """Each capture's replay runs on the serving's state (its rows copied into the graph's static
    ones) and is compared with the uncompiled step before it serves: the bucket whose replay is
    off is named among the failed and never replayed; the others are."""
    torch.set_num_threads(1)
    runner = tiny_runner(tiny_model, 4)
    try:
        runner.whole = EagerWhole(runner.model, (2, 4), in_place=True, decoder=runner.vae)
        off = OffReplay(RecordingLock(), bucket=2)
        with caplog.at_level(logging.WARNING, logger="vox_ws.engines.voxcpm"):
            runner.capture_whole(off)       # as a start captures: the runner's own comparison
        name = f"2x{runner.max_len}x10"
        assert set(runner.captured.failed) == {name}
        assert "replay differs from the uncompiled step" in runner.captured.failed[name]
        assert "audio" in runner.captured.failed[name]
        assert runner.captured.replay(2, 10, 10, True, torch.zeros(2, 3, dtype=torch.long)) is None
        with torch.inference_mode():
            assert runner.captured.replay(4, 10, 10, True, _padding_rows(runner, 4)) is not None
        assert any("not captured" in r.getMessage() for r in caplog.records)
    finally:
        runner.close()


def _padding_rows(runner, bucket: int) -> torch.Tensor:
    return torch.tensor([[runner.base_kv.padding_slot, 1, 0]] * bucket, dtype=torch.long)


class FakeCuda:
    """`torch.cuda` as `CudaCapture` calls it, recording the streams made and each capture's
    stream and pool."""

    def __init__(self) -> None:
        self.streams: list[object] = []
        self.captured_on: list[tuple[object, object]] = []

    def graph_pool_handle(self) -> object:
        return object()

    class _Stream:
        def wait_stream(self, other) -> None:
            pass

        def synchronize(self) -> None:
            pass

    def Stream(self, device):  # noqa: N802 - torch.cuda's name
        stream = self._Stream()
        self.streams.append(stream)
        return stream

    def current_stream(self, device):
        return self._Stream()

    def stream(self, stream):
        return contextlib.nullcontext()

    def CUDAGraph(self):  # noqa: N802 - torch.cuda's name
        return types.SimpleNamespace(replay=lambda: None)

    def graph(self, graph, pool, stream, capture_error_mode):
        self.captured_on.append((stream, pool))
        return contextlib.nullcontext()


def test_every_capture_of_one_capturer_is_made_on_its_one_side_stream_into_its_one_pool():
    """torch asks captures that share a pool to use the same stream (`torch.cuda.graph`'s note):
    one side stream per capturer, made once, whatever the number of captures."""
    cuda = FakeCuda()
    capture = CudaCapture(torch.device("cuda"), cuda=cuda)
    for rows in (4, 2, 1):
        capture(lambda rows=rows: (torch.zeros(rows),))
    assert len(cuda.streams) == 1
    assert [stream for stream, _ in cuda.captured_on] == [capture.stream] * 3
    assert len({id(pool) for _, pool in cuda.captured_on}) == 1 and cuda.captured_on[0][1] is capture.pool
