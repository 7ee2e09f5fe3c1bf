"""Single-process tests of torchhpc.rehearsal: reservoir statistics, sampling, buffer semantics, bad input."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from torchhpc.rehearsal import AugmentedBatch, ClassReservoir, RehearsalBuffer, RehearsalLoader
from torchhpc.rehearsal.sampler import draw_representatives

P_REJECT = 1e-3  # fixed significance: every statistical check below uses fixed seeds, so it is deterministic


def chi_square(observed: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """Pearson statistic and the rejection threshold at P_REJECT."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, float(chi2.ppf(1 - P_REJECT, len(observed) - 1))


def retention_by_position(policy, stream_len: int, slots: int, trials: int, bins: int, seed: int):
    """How often samples from each stream segment (one class) are still held at the end."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(bins)
    for _ in range(trials):
        held = policy(stream_len, slots, rng)
        np.add.at(counts, np.asarray(held) * bins // stream_len, 1)
    return counts


def ours(stream_len: int, slots: int, rng: np.random.Generator) -> list[int]:
    """Feed positions 0..stream_len-1 of one class through ClassReservoir in minibatches of 7 candidates."""
    res = ClassReservoir(1, slots)
    store = [-1] * slots
    for start in range(0, stream_len, 7):
        ids = np.arange(start, min(start + 7, stream_len))
        w = res.offer(np.zeros(len(ids), dtype=np.int64), rng)
        for row, slot in zip(w.rows, w.slots, strict=True):
            store[slot] = int(ids[row])
    return store


def neomem_like(stream_len: int, slots: int, rng: np.random.Generator, batch: int = 7) -> list[int]:
    """Neomem-style per-class random replacement: once full, a draw in [0, batch) replaces slot j if j < N."""
    store: list[int] = []
    for i in range(stream_len):
        if len(store) < slots:
            store.append(i)
        else:
            j = int(rng.integers(0, max(batch, slots + 1)))
            if j < slots:
                store[j] = i
    return store


def test_reservoir_retention_is_uniform_over_the_stream() -> None:
    counts = retention_by_position(ours, stream_len=100, slots=10, trials=1200, bins=10, seed=1)
    assert counts.sum() == 1200 * 10
    stat, limit = chi_square(counts, np.full(10, counts.sum() / 10))
    assert stat < limit, f"retention not uniform over the stream: chi2={stat:.1f} >= {limit:.1f}, {counts}"


def test_uniformity_check_catches_recency_bias() -> None:
    counts = retention_by_position(neomem_like, stream_len=100, slots=10, trials=1200, bins=10, seed=1)
    stat, limit = chi_square(counts, np.full(10, counts.sum() / 10))
    assert stat > limit, "the chi-square check should reject the recency-biased replacement policy"
    assert counts[-1] > 5 * counts[0]


def test_reservoir_is_per_class_and_balanced() -> None:
    rng = np.random.default_rng(3)
    res = ClassReservoir(3, 5)
    labels = np.array([0] * 40 + [1] * 3 + [2] * 100)
    rng.shuffle(labels)
    for chunk in np.array_split(labels, 13):
        w = res.offer(chunk, rng)
        assert len(set(zip(w.labels.tolist(), w.slots.tolist(), strict=True))) == len(w.slots)
        assert (w.slots < 5).all()
    assert res.fill.tolist() == [5, 3, 5]
    assert res.seen.tolist() == [40, 3, 100]


def test_draw_representatives_uniform_over_ranks_and_classes() -> None:
    fills = np.array([[5, 0, 2], [1, 4, 0], [0, 0, 8]])
    rng = np.random.default_rng(7)
    hits = np.zeros(fills.size)
    for _ in range(2000):
        ranks, flat = draw_representatives(fills, 8, 6, rng)
        assert len(set(zip(ranks.tolist(), flat.tolist(), strict=True))) == 6  # without replacement
        assert (np.diff(ranks) >= 0).all()
        cls, slot = flat // 8, flat % 8
        assert (slot < fills[ranks, cls]).all()  # only filled slots
        np.add.at(hits, ranks * 3 + cls, 1)
    nonzero = fills.reshape(-1) > 0
    assert hits[~nonzero].sum() == 0
    expected = fills.reshape(-1)[nonzero] / fills.sum() * hits.sum()
    stat, limit = chi_square(hits[nonzero], expected)
    assert stat < limit


def test_draw_representatives_returns_what_is_available() -> None:
    ranks, flat = draw_representatives(np.array([[2, 1]]), 4, 10, np.random.default_rng(0))
    assert sorted(flat.tolist()) == [0, 1, 4]
    ranks, flat = draw_representatives(np.zeros((2, 3), dtype=np.int64), 4, 10, np.random.default_rng(0))
    assert len(flat) == 0


# ---------------------------------------------------------------------------- buffer
def encoded_batch(labels: torch.Tensor, ids: torch.Tensor, shape=(2, 3)) -> torch.Tensor:
    """Samples whose every element is ``label + 100 * id``: a tear or mismatch shows at once."""
    v = (labels + 100 * ids).float()
    return v.view(-1, *([1] * len(shape))).expand(-1, *shape).contiguous()


def check_encoded(samples: torch.Tensor, targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    flat = samples.reshape(samples.shape[0], -1) if len(samples) else samples.reshape(0, 1)
    assert (flat == flat[:, :1]).all(), "a sample mixes two stored samples"
    values = flat[:, 0].long()
    assert torch.equal(values % 100, targets), "a representative came back with another sample's label"
    assert (targets < num_classes).all()
    return values // 100


def local_buffer(**kw) -> RehearsalBuffer:
    args = dict(num_classes=4, slots_per_class=5, num_candidates=3, num_representatives=4,
                sample_shapes=(2, 3), global_sampling=False, seed=0)
    args.update(kw)
    return RehearsalBuffer(**args)


def test_augmented_batch_pairs_samples_with_labels() -> None:
    with local_buffer() as buf:
        gen = torch.Generator().manual_seed(0)
        for step in range(20):
            y = torch.randint(0, 4, (6,), generator=gen)
            ids = torch.arange(6) + 6 * step
            buf.accumulate(encoded_batch(y, ids), y)
            out = buf.wait()
            assert isinstance(out, AugmentedBatch)
            m = buf.last_num_representatives
            assert out.samples.shape == (6 + m, 2, 3)
            got = check_encoded(out.samples, out.targets, 4)
            assert torch.equal(got[:6], ids)
            assert (got[6:] < 6 * step).all()  # representatives come from earlier batches only
            assert torch.equal(out.weights, torch.ones(6 + m))
            assert out.activations is None
        st = buf.stats()
        assert st["size"] == sum(st["fill"]) and max(st["fill"]) <= 5
        assert sum(st["samples_seen"]) == 120 and sum(st["candidates_seen"]) == 60
        assert set(st["timings_ms"]) >= {"sampling", "remote_fetch", "copy", "update"}


def test_end_to_end_retention_uniform() -> None:
    """Through the real buffer: each of 40 batches holds one sample of each of 50 classes."""
    positions = np.zeros(40)
    for seed in range(4):
        with local_buffer(num_classes=50, slots_per_class=4, num_candidates=25, num_representatives=0,
                          sample_shapes=(1,), seed=seed) as buf:
            for step in range(40):
                y = torch.arange(50)
                buf.accumulate(encoded_batch(y, torch.full((50,), step), shape=(1,)), y)
                buf.wait()
            ids = buf.storage.samples[0][:, 0].long() // 100
            positions += np.bincount(ids.numpy(), minlength=40)
    binned = positions.reshape(8, 5).sum(1)
    assert binned.sum() == 4 * 50 * 4
    stat, limit = chi_square(binned, np.full(8, binned.sum() / 8))
    assert stat < limit, f"chi2={stat:.1f} >= {limit:.1f}: {binned}"


def test_requesting_more_than_available_returns_what_is_there() -> None:
    with local_buffer(num_representatives=50) as buf:
        y = torch.tensor([0, 1, 1])
        buf.accumulate(encoded_batch(y, torch.arange(3)), y)
        assert buf.wait().samples.shape[0] == 3 and buf.last_num_representatives == 0
        buf.accumulate(encoded_batch(y, torch.arange(3, 6)), y)
        out = buf.wait()
        assert buf.last_num_representatives == 3 == buf.stats()["last_num_representatives"]
        assert out.samples.shape[0] == 6


def test_multi_tensor_representatives_and_kd() -> None:
    shapes = [(2, 2), (3,), (1, 4)]
    with local_buffer(sample_shapes=shapes, task="rehearsal+kd", activation_shape=(5,),
                      sample_dtypes=[torch.float32, torch.float64, torch.int32], rehearsal_weight=0.5) as buf:
        for step in range(6):
            y = torch.tensor([0, 1, 2, 3, 1])
            ids = torch.arange(5) + 5 * step
            xs = [encoded_batch(y, ids, s).to(d) for s, d in zip(shapes, buf.sample_dtypes, strict=True)]
            acts = -encoded_batch(y, ids, (5,))
            buf.accumulate(xs, y, acts)
            out = buf.wait()
            assert isinstance(out.samples, list) and len(out.samples) == 3
            got = check_encoded(out.samples[0], out.targets, 4)
            for s in out.samples[1:]:
                assert torch.equal(check_encoded(s.float(), out.targets, 4), got)
            assert torch.equal(check_encoded(-out.activations, out.targets, 4), got)
            assert (out.weights[5:] == 0.5).all() and (out.weights[:5] == 1).all()
    with local_buffer(task="kd", activation_shape=(2,)) as buf:
        for _ in range(3):
            y = torch.tensor([0, 1])
            buf.accumulate(torch.zeros(2, 2, 3), y, torch.zeros(2, 2))
            out = buf.wait()
        assert (out.weights[2:] == 0).all() and len(out.weights) > 2  # DER: representatives only distil


def test_flyweight_mode_fills_caller_tensors() -> None:
    with local_buffer(mode="flyweight", num_representatives=3) as buf:
        out = AugmentedBatch(torch.full((3, 2, 3), -1.0), torch.zeros(3, dtype=torch.int64),
                             torch.zeros(3), None)
        for step in range(5):
            y = torch.tensor([0, 1, 2, 3])
            buf.accumulate(encoded_batch(y, torch.arange(4) + 4 * step), y, out=out)
            res = buf.wait()
            m = buf.last_num_representatives
            assert res.samples.shape[0] == m
            assert m == 0 or res.samples.data_ptr() == out.samples.data_ptr()
            check_encoded(res.samples, res.targets, 4)
        assert m == 3
        with pytest.raises(ValueError, match="flyweight"):
            buf.accumulate(torch.zeros(1, 2, 3), torch.tensor([0]))
        small = AugmentedBatch(torch.zeros(2, 2, 3), torch.zeros(2, dtype=torch.int64), torch.zeros(2), None)
        with pytest.raises(ValueError, match="cannot hold 3 rows"):
            buf.accumulate(torch.zeros(1, 2, 3), torch.tensor([0]), out=small)


def test_bad_input_is_rejected_and_buffer_untouched() -> None:
    with local_buffer() as buf:
        with pytest.raises(RuntimeError, match="without a pending accumulate"):
            buf.wait()
        with pytest.raises(ValueError, match="per-sample shape"):
            buf.accumulate(torch.zeros(2, 3, 2), torch.tensor([0, 1]))
        with pytest.raises(TypeError, match="dtype torch.float64"):
            buf.accumulate(torch.zeros(2, 2, 3, dtype=torch.float64), torch.tensor([0, 1]))
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
            buf.accumulate(torch.zeros(2, 2, 3), torch.tensor([0, 4]))
        with pytest.raises(ValueError, match=r"labels must lie"):
            buf.accumulate(torch.zeros(2, 2, 3), torch.tensor([-1, 0]))
        with pytest.raises(TypeError, match="integer tensor"):
            buf.accumulate(torch.zeros(2, 2, 3), torch.tensor([0.0, 1.0]))
        with pytest.raises(ValueError, match="targets have shape"):
            buf.accumulate(torch.zeros(2, 2, 3), torch.tensor([0, 1, 2]))
        with pytest.raises(ValueError, match="stores none"):
            buf.accumulate(torch.zeros(2, 2, 3), torch.tensor([0, 1]), torch.zeros(2, 3))
        assert buf.stats()["size"] == 0 and buf.stats()["iterations"] == 0
        for _ in range(4):
            buf.accumulate(torch.zeros(1, 2, 3), torch.tensor([0]))
        with pytest.raises(RuntimeError, match="pending"):
            buf.accumulate(torch.zeros(1, 2, 3), torch.tensor([0]))
        with pytest.raises(RuntimeError, match="waited"):
            buf.state_dict()
        for _ in range(4):
            buf.wait()
    with pytest.raises(ValueError, match="activation_shape"):
        local_buffer(task="kd")
    with pytest.raises(ValueError, match="task must be one of"):
        local_buffer(task="classification")
    with pytest.raises(ValueError, match="num_candidates"):
        local_buffer(num_candidates=0)
    kd = local_buffer(task="kd", activation_shape=(3,))
    with pytest.raises(ValueError, match="needs the activations"):
        kd.accumulate(torch.zeros(1, 2, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="activations have shape"):
        kd.accumulate(torch.zeros(1, 2, 3), torch.tensor([0]), torch.zeros(1, 4))
    kd.close()
    with pytest.raises(RuntimeError, match="closed"):
        kd.accumulate(torch.zeros(1, 2, 3), torch.tensor([0]), torch.zeros(1, 3))


def run_steps(buf: RehearsalBuffer, start: int, steps: int) -> list[torch.Tensor]:
    outs = []
    for step in range(start, start + steps):
        y = torch.tensor([step % 4, (step + 1) % 4, 3])
        buf.accumulate(encoded_batch(y, torch.arange(3) + 3 * step), y)
        outs.append(buf.wait().samples.clone())
    return outs


def test_state_round_trip_continues_exactly(tmp_path) -> None:
    a = local_buffer(seed=5)
    run_steps(a, 0, 12)
    path = tmp_path / "buf.pt"
    torch.save(a.state_dict(), path)
    expected = run_steps(a, 12, 8)
    stats_a = a.stats()
    a.close()
    b = local_buffer(seed=99)  # a different seed: the saved random state must win
    b.load_state_dict(torch.load(path))  # weights_only=True, the default
    got = run_steps(b, 12, 8)
    assert all(torch.equal(x, y) for x, y in zip(expected, got, strict=True))
    assert b.stats()["fill"] == stats_a["fill"] and b.stats()["samples_seen"] == stats_a["samples_seen"]
    other = local_buffer(slots_per_class=6)
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(b.state_dict())
    b.close()
    other.close()


def test_loader_wrapper_pipelines_and_drains_on_break() -> None:
    data = []
    for step in range(8):
        y = torch.tensor([step % 4, 2])
        data.append((encoded_batch(y, torch.arange(2) + 2 * step), y))
    with local_buffer() as buf:
        loader = RehearsalLoader(data, buf)
        assert len(loader) == 8
        seen = []
        for batch in loader:
            ids = check_encoded(batch.samples, batch.targets, 4)
            seen.append(ids[:2].tolist())
            assert buf._pending == (0 if len(seen) == 8 else 1)  # the next batch is already in flight
        assert seen == [[2 * s, 2 * s + 1] for s in range(8)]
        for i, _ in enumerate(RehearsalLoader(data, buf)):
            if i == 2:
                break
        assert buf._pending == 0  # the in-flight batch was drained, the buffer stays usable
        run_steps(buf, 100, 1)
    with local_buffer(task="kd", activation_shape=(1,)) as buf:
        calls = []
        loader = RehearsalLoader(data[:3], buf, activations=lambda x: calls.append(1) or x[:, :1, 0])
        outs = list(loader)
        assert len(outs) == 3 and len(calls) == 3
        assert torch.equal(outs[-1].activations[:2], data[2][0][:, :1, 0])


def test_cuda_device_without_gpu_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; see test_cuda_outputs")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        local_buffer(device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_outputs() -> None:
    with local_buffer(device="cuda") as buf:
        for step in range(5):
            y = torch.tensor([0, 1, 2])
            buf.accumulate(encoded_batch(y, torch.arange(3) + 3 * step).cuda(), y.cuda())
            out = buf.wait()
            assert out.samples.is_cuda and out.targets.is_cuda and out.weights.is_cuda
            check_encoded(out.samples.cpu(), out.targets.cpu(), 4)
        assert buf.storage.bytes.is_pinned()


def test_output_memory_is_recycled_only_when_released() -> None:
    with local_buffer() as buf:
        kept = []
        for step in range(8):
            y = torch.tensor([0, 1, 2])
            buf.accumulate(encoded_batch(y, torch.arange(3) + 3 * step), y)
            out = buf.wait()
            kept.append((out.samples[:3], out.targets.numpy()))  # a view and a numpy array keep memory alive
        for step, (samples, targets) in enumerate(kept):
            ids = check_encoded(samples, torch.from_numpy(targets[:3]), 4)
            assert torch.equal(ids, torch.arange(3) + 3 * step), "a held batch was overwritten"
        del kept, samples, targets, out
        ptrs = set()
        for step in range(8, 16):
            y = torch.tensor([0, 1, 2])
            buf.accumulate(encoded_batch(y, torch.arange(3) + 3 * step), y)
            out = buf.wait()
            ptrs.add(out.samples.data_ptr())
            del out
        assert len(ptrs) == 1  # released batches are reused instead of reallocated


def test_launcher_world_must_match_mpi_world(monkeypatch) -> None:
    """torchrun-style variables for 2 processes while MPI sees one: global sampling would be a lie."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="says rank 0 of 2 but MPI.COMM_WORLD is rank 0 of 1"):
        RehearsalBuffer(2, 2, 1, 1, (1,))
    local_buffer().close()  # local sampling does not care


def test_spare_rows_collate_avoids_copying_new_samples() -> None:
    from torch.utils.data import DataLoader

    from torchhpc.rehearsal import spare_rows_collate

    ids = torch.arange(24)
    labels = ids % 4
    dataset = list(zip(encoded_batch(labels, ids), labels.tolist(), strict=True))
    with local_buffer(num_representatives=3) as buf:
        loader = DataLoader(dataset, batch_size=4, collate_fn=spare_rows_collate(buf))
        x, y, out = next(iter(loader))
        assert x.shape == (4, 2, 3) and out.samples.shape == (7, 2, 3) and x.data_ptr() == out.samples.data_ptr()
        for i, batch in enumerate(RehearsalLoader(loader, buf)):
            got = check_encoded(batch.samples, batch.targets, 4)
            assert torch.equal(got[:4], ids[4 * i : 4 * i + 4])
            assert batch.weights.shape[0] == batch.samples.shape[0]
            if i > 0:
                assert buf.last_num_representatives == 3 and batch.samples.shape[0] == 7
        with pytest.raises(ValueError, match="cannot hold 7 rows"):
            small = AugmentedBatch(torch.zeros(5, 2, 3), torch.zeros(5, dtype=torch.int64), torch.zeros(5), None)
            buf.accumulate(torch.zeros(4, 2, 3), torch.zeros(4, dtype=torch.int64), out=small)


def test_worker_thread_runs_at_the_requested_niceness() -> None:
    import os
    import sys

    with pytest.raises(ValueError, match="worker_niceness"):
        local_buffer(worker_niceness=20)
    with pytest.raises(ValueError, match="worker_niceness"):
        local_buffer(worker_niceness=-1)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform.startswith("linux") else 0
    with local_buffer(worker_niceness=7) as buf:
        run_steps(buf, 0, 1)  # the worker has started and set its priority
        if sys.platform.startswith("linux"):
            assert os.getpriority(os.PRIO_PROCESS, buf._worker.native_id) == max(caller, 7)
            assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller  # the caller keeps its own


def test_new_samples_copied_in_pieces_arrive_whole(monkeypatch) -> None:
    import torchhpc.rehearsal.buffer as buffer_module

    monkeypatch.setattr(buffer_module, "_COPY_CHUNK", 2 * 2 * 3 * 4)  # two rows of (2, 3) float32 per piece
    with local_buffer(num_representatives=2) as buf:
        for step in range(4):
            y = torch.arange(7) % 4
            buf.accumulate(encoded_batch(y, torch.arange(7) + 7 * step), y)
            out = buf.wait()
            ids = check_encoded(out.samples, out.targets, 4)
            assert torch.equal(ids[:7], torch.arange(7) + 7 * step)


def test_loader_batches_held_by_the_caller_are_never_overwritten() -> None:
    """Output memory is recycled, but only once the caller has let go: batches kept across steps stay intact."""
    data = []
    for step in range(10):
        y = torch.tensor([step % 4, (step + 1) % 4, 3])
        data.append((encoded_batch(y, torch.arange(3) + 3 * step), y))
    with local_buffer() as buf:
        kept = list(RehearsalLoader(data, buf))  # every batch held while all later ones are built
        for step, batch in enumerate(kept):
            assert torch.equal(check_encoded(batch.samples, batch.targets, 4)[:3], torch.arange(3) + 3 * step)
        del kept, batch
        ptrs = set()
        for batch in RehearsalLoader(data, buf):  # the usual loop: one batch in training, one being built
            ptrs.add(batch.samples.data_ptr())
        del batch
        assert len(ptrs) <= 3, "released batches should be reused, not reallocated every step"


def test_worker_holds_a_new_batch_back_only_until_it_is_waited_for() -> None:
    import time

    with pytest.raises(ValueError, match="start_delay"):
        local_buffer(start_delay=-0.1)
    with local_buffer(start_delay=5.0) as buf:
        y = torch.tensor([0, 1, 2])
        buf.accumulate(encoded_batch(y, torch.arange(3)), y)
        time.sleep(0.1)
        assert buf.stats()["iterations"] == 0, "the worker should still hold the batch back"
        t0 = time.perf_counter()
        out = buf.wait()  # asking for it ends the hold at once
        assert time.perf_counter() - t0 < 2.5
        assert torch.equal(check_encoded(out.samples, out.targets, 4)[:3], torch.arange(3))
        t0 = time.perf_counter()
        run_steps(buf, 1, 5)  # accumulate then wait straight away: never held back
        assert time.perf_counter() - t0 < 2.5


def test_options_object_and_keywords_are_one_convention() -> None:
    """RehearsalOptions holds every setting; keywords that are given override its fields; validate() names the field."""
    import dataclasses

    from torchhpc.rehearsal import RehearsalOptions

    opts = RehearsalOptions(4, 8, 4, 2, (3,), global_sampling=False, seed=1, max_pending=2)
    opts.validate()
    with RehearsalBuffer(options=opts) as buf:
        assert (buf.K, buf.N, buf.C, buf.R, buf.max_pending) == (4, 8, 4, 2, 2) and buf.options == opts
    with RehearsalBuffer(num_representatives=3, options=opts) as buf:  # the keyword wins
        assert buf.R == 3 and buf.options.seed == 1
    for field, value in (("num_classes", 0), ("task", "nope"), ("mode", "fast"), ("transport", "tcp"),
                         ("worker_niceness", 20), ("start_delay", -1.0), ("timeout", float("nan")),
                         ("progress_interval", -1.0)):
        bad = dataclasses.replace(opts, **{field: value})
        with pytest.raises(ValueError, match=field):
            bad.validate()
        with pytest.raises(ValueError, match=field):
            RehearsalBuffer(options=bad)
    with pytest.raises(TypeError, match="num_classes"):
        RehearsalBuffer(slots_per_class=8, num_candidates=4, num_representatives=2, sample_shapes=(3,),
                        global_sampling=False)
    with pytest.raises(TypeError, match="RehearsalOptions"):
        RehearsalBuffer(options={"num_classes": 4})
