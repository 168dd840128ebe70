"""``fastinit publish``: a checkpoint saved by 4 gloo ranks (a plan mixing sharding types, one
training step of the fused and dense optimizers) loaded into the unsharded model on a world of
one, written (safetensors or torch.save, torch.export of the dense part) and verified against the
batch and output rank 0 recorded at save time, with the checkpoint read-only, while a 2-rank
training job keeps training and saving in its own processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import stat
import textwrap
import time
from typing import Any

import pytest

from fastinit.testing.dist import run_ranks

SPEC: dict[str, Any] = {
    "num_tables": 4,
    "num_weighted_tables": 1,
    "num_ec_tables": 2,
    "rows": 64,
    "dims": (8, 16),
}

FACTORY = textwrap.dedent(
    f"""
    from fastinit.testing.models import ModelSpec, build_model

    def build(device: str = "meta"):
        return build_model(ModelSpec(**{SPEC!r}), device=device)
    """
)


pytestmark = pytest.mark.usefixtures("fastinit_logger_restored")


def _save_rank(ckpt_dir: str) -> bool:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import fastinit
    from fastinit.checkpoint import record_verification, save
    from fastinit.testing.models import ModelSpec, build_model, build_plan, make_batch

    rank = dist.get_rank()
    spec = ModelSpec(**SPEC)
    module = build_model(spec, device="meta")
    plan = build_plan(
        module,
        ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"],
        dist.get_world_size(),
        local_world_size=2,
    )
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    sharders = [
        EmbeddingBagCollectionSharder(fused_params=dict(fused)),
        EmbeddingCollectionSharder(fused_params=dict(fused)),
    ]
    model = fastinit.setup(module, plan=plan, sharders=sharders, seed=0)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    optimizer.zero_grad()
    loss, _ = model(make_batch(spec, 16, seed=10 + rank))
    loss.backward()
    optimizer.step()
    save(ckpt_dir, model, {"optim": optimizer}, blocking=True)
    batch = make_batch(spec, 8, seed=100 + rank)
    with torch.no_grad():
        output = model(batch)
    record_verification(ckpt_dir, batch, output, training=True, rank=rank)
    return True


def _train_on_rank(root: str, stop_file: str) -> int:
    """A training job that keeps going: a step and a checkpoint ``root/job-step-<k>`` per
    iteration until ``stop_file`` exists (rank 0 decides, every rank follows)."""
    import torch
    import torch.distributed as dist

    import fastinit
    from fastinit.checkpoint import save
    from fastinit.testing.models import ModelSpec, build_model, build_plan, make_batch

    rank = dist.get_rank()
    spec = ModelSpec(**SPEC)
    module = build_model(spec, device="meta")
    plan = build_plan(module, "table_wise", dist.get_world_size())
    model = fastinit.setup(module, plan=plan, seed=0)
    step = 0
    while True:
        step += 1
        loss, _ = model(make_batch(spec, 16, seed=1000 * step + rank))
        loss.backward()
        save(os.path.join(root, f"job-step-{step}"), model, blocking=True)
        if rank == 0 and step == 1:
            pathlib.Path(root, "job-running").touch()
        stop = torch.tensor([int(rank == 0 and os.path.exists(stop_file))])
        dist.broadcast(stop, src=0)
        if stop.item():
            return step


def _training_job(root: str, stop_file: str) -> None:
    """The job, in its own process and process group (2 gloo ranks)."""
    steps = run_ranks(_train_on_rank, 2, args=(root, stop_file), timeout=900)
    pathlib.Path(root, "job-done").write_text(json.dumps(steps))


def _read_only(root: pathlib.Path) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.mark.slow  # 4 + 2 spawned ranks: minutes
@pytest.mark.timeout(900)
def test_publish_a_4_rank_checkpoint_on_a_world_of_one(tmp_path: pathlib.Path) -> None:
    from fastinit import cli
    from fastinit.checkpoint.publishing import VERIFY_FILE

    ckpt = tmp_path / "ckpt" / "step-1"
    run_ranks(_save_rank, 4, args=(str(ckpt),), timeout=540, local_world_size=2)
    assert (ckpt / VERIFY_FILE).exists()
    factory = tmp_path / "my_model.py"
    factory.write_text(FACTORY)
    # A training job keeps going (its own processes and process group, saving a checkpoint
    # every step beside this one) while publish reads the committed checkpoint.
    job_root = tmp_path / "job"
    job_root.mkdir()
    stop_file = job_root / "stop"
    job = multiprocessing.get_context("spawn").Process(
        target=_training_job, args=(str(job_root), str(stop_file))
    )
    job.start()
    try:
        deadline = time.monotonic() + 500
        while not (job_root / "job-running").exists():
            assert job.is_alive() and time.monotonic() < deadline, "the training job did not start"
            time.sleep(0.5)
        _read_only(ckpt)  # publish only reads
        before = sorted((p.name, p.stat().st_mtime_ns) for p in ckpt.rglob("*"))
        out = tmp_path / "serving"
        try:
            argv = ["publish", str(ckpt), "--out", str(out), "--model", f"{factory}:build"]
            assert cli.main([*argv, "--json"]) == 0
        finally:
            for path in [ckpt, *ckpt.rglob("*")]:
                path.chmod(path.stat().st_mode | stat.S_IWUSR)
        assert job.is_alive(), "the training job stopped while publish ran"
    finally:
        stop_file.touch()
        job.join(300)
        if job.is_alive():
            job.kill()
    assert job.exitcode == 0 and (job_root / "job-done").exists(), job.exitcode
    assert len(json.loads((job_root / "job-done").read_text())) == 2
    assert sorted((p.name, p.stat().st_mtime_ns) for p in ckpt.rglob("*")) == before
    with open(out / "publish.json") as f:
        report = json.load(f)
    assert report["verified"] is True, report
    assert report["load"].startswith(("dcp resharded", "fastinit.checkpoint.load")), report
    assert set(report["exported"]) == {"dense_arch", "over_arch"}, report["export_errors"]

    # The state_dict on disk is the checkpoint's model, whole; the exported programs run.
    import torch

    from fastinit.checkpoint import load_unsharded

    model = torch.nn.Module()
    exec_ns: dict[str, Any] = {}
    exec(FACTORY, exec_ns)  # noqa: S102 - the test's own factory
    model = exec_ns["build"](device="cpu")
    load_unsharded(str(ckpt), model)
    if report["format"] == "safetensors":
        from safetensors.torch import load_file

        written = load_file(report["state_dict_file"])
    else:
        written = torch.load(report["state_dict_file"], weights_only=True)
    expected = model.state_dict()
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(written[name], value), name
    program = torch.export.load(report["exported"]["dense_arch"])
    x = torch.randn(3, model.spec.dense_in)
    torch.testing.assert_close(program.module()(x), model.dense_arch(x))

    # Nothing is overwritten: a second publish to the same directory is refused.
    assert cli.main(["publish", str(ckpt), "--out", str(out), "--model", f"{factory}:build"]) == 2
    assert os.path.exists(out / "publish.json")


def _small_checkpoint(path: pathlib.Path) -> Any:
    """A world-of-one DCP checkpoint of the unsharded model, with a recorded batch."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fastinit.checkpoint import record_verification
    from fastinit.testing.models import ModelSpec, build_model, make_batch

    spec = ModelSpec(**SPEC)
    model = build_model(spec, device="cpu", seed=3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    batch = make_batch(spec, 4, seed=1)
    with torch.no_grad():
        record_verification(str(path), batch, model(batch))
    return model


def test_publish_writes_verifies_and_refuses_bad_input(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    import torch

    from fastinit.checkpoint import PublishError, publish
    from fastinit.testing.models import ModelSpec, build_model

    ckpt = tmp_path / "ckpt"
    trained = _small_checkpoint(ckpt)
    report = publish(str(ckpt), str(tmp_path / "out"), build_model(ModelSpec(**SPEC), "meta"))
    assert report.verified is True and report.max_abs_diff == 0.0
    assert set(report.exported) == {"dense_arch", "over_arch"}
    # A model whose values differ from the recorded output's fails the verification.
    with open(ckpt / "fastinit-verify.pt", "rb") as f:
        record = torch.load(f, weights_only=False)
    record["output"] = (record["output"][0] + 1, record["output"][1])
    other = tmp_path / "other-record.pt"
    torch.save(record, other)
    bad = publish(str(ckpt), str(tmp_path / "out2"), trained, batch_file=str(other), export=False)
    assert bad.verified is False
    # Bad input: an output inside the checkpoint, a non-empty output, another model's checkpoint.
    fresh = build_model(ModelSpec(**SPEC), "cpu")
    with pytest.raises(PublishError, match="inside the checkpoint"):
        publish(str(ckpt), str(ckpt / "x"), fresh)
    with pytest.raises(PublishError, match="not empty"):
        publish(str(ckpt), str(tmp_path / "out"), fresh)
    wrong = build_model(ModelSpec(**{**SPEC, "rows": 32}), "cpu")
    with pytest.raises(PublishError, match="does not fit"):
        publish(str(ckpt), str(tmp_path / "out3"), wrong)
    assert not (tmp_path / "out3").exists()
    with pytest.raises(PublishError, match="no such checkpoint"):
        publish(str(tmp_path / "nothing"), str(tmp_path / "out4"), fresh)
    # Without safetensors: torch.save.
    real_import = builtins.__import__

    def no_safetensors(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("safetensors"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_safetensors)
    plain = publish(str(ckpt), str(tmp_path / "out5"), fresh, export=False)
    assert plain.format == "torch.save" and plain.verified is True and not plain.exported
    written = torch.load(plain.state_dict_file, weights_only=True)
    assert all(torch.equal(written[k], v) for k, v in trained.state_dict().items())


REORDER_SPEC: dict[str, Any] = {"num_tables": 4, "num_weighted_tables": 2, "rows": 32}


def _save_reordered_rank(ckpt_dir: str) -> list[str]:
    """A table-wise plan on 2 ranks puts tables 0, 2 on rank 0 and 1, 3 on rank 1: the sharded
    EBC returns its keys in that order (f0, f2, f1, f3), not the tables' order."""
    import torch
    import torch.distributed as dist

    import fastinit
    from fastinit.checkpoint import record_verification, save
    from fastinit.testing.models import ModelSpec, build_model, build_plan, make_batch

    rank = dist.get_rank()
    spec = ModelSpec(**REORDER_SPEC)
    module = build_model(spec, device="meta")
    plan = build_plan(module, "table_wise", dist.get_world_size())
    model = fastinit.setup(module, plan=plan, seed=0)
    save(ckpt_dir, model, blocking=True)
    batch = make_batch(spec, 8, seed=100 + rank)
    with torch.no_grad():
        keys = list(model.module.sparse.ebc(batch.sparse).keys())
        output = model(batch)
    record_verification(ckpt_dir, batch, output, training=True, rank=rank)
    return keys


def test_publish_verifies_when_the_plan_reorders_the_tables(tmp_path: pathlib.Path) -> None:
    """The sharded and the unsharded model compute the same function whatever order the plan
    puts the tables in (the reference model reads the pooled embeddings by key)."""
    from fastinit.checkpoint import publish
    from fastinit.testing.models import ModelSpec, build_model

    ckpt = tmp_path / "ckpt"
    keys = run_ranks(_save_reordered_rank, 2, args=(str(ckpt),), timeout=240)
    spec = ModelSpec(**REORDER_SPEC)
    tables_order = build_model(spec, "meta").sparse.ebc_features
    assert keys[0] != tables_order and sorted(keys[0]) == sorted(tables_order), keys
    report = publish(str(ckpt), str(tmp_path / "out"), build_model(spec, "meta"), export=False)
    assert report.verified is True, report


def test_publish_without_a_recorded_batch_publishes_and_says_so(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose trainer never called ``record_verification``: published, what could
    not be verified said, exit status 3 (not 1, "the output differs"), with and without --json;
    the command's other statuses beside it."""
    import torch

    from fastinit.cli import main

    # docs/publish.md's exit statuses
    verified, differs, bad_input, not_verified = 0, 1, 2, 3

    ckpt = tmp_path / "ckpt"
    _small_checkpoint(ckpt)
    (tmp_path / "my_model.py").write_text(FACTORY)
    model = f"{tmp_path / 'my_model.py'}:build"
    recorded = tmp_path / "recorded.pt"
    (ckpt / "fastinit-verify.pt").rename(recorded)

    assert main(["publish", str(ckpt), "--out", str(tmp_path / "a"), "--model", model]) == (
        not_verified
    )
    out = capsys.readouterr().out
    assert "not verified: the checkpoint holds no recorded batch" in out
    assert "record_verification" in out and "not exported" in out
    assert (tmp_path / "a" / "model.safetensors").is_file()
    argv = ["publish", str(ckpt), "--out", str(tmp_path / "b"), "--model", model, "--json"]
    assert main(argv) == not_verified
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] is None and "no recorded batch" in report["not_verified"]
    assert json.loads((tmp_path / "b" / "publish.json").read_text())["verified"] is None

    # The recorded batch given explicitly: verified (0); a tampered one: differs (1); a missing
    # one: bad input (2), nothing written.
    argv = ["publish", str(ckpt), "--model", model, "--no-export", "--batch"]
    assert main([*argv, str(recorded), "--out", str(tmp_path / "c")]) == verified
    assert "verified: the recorded batch gives the recorded output" in capsys.readouterr().out
    record = torch.load(recorded, weights_only=False)
    record["output"] = (record["output"][0] + 1, record["output"][1])
    tampered = tmp_path / "tampered.pt"
    torch.save(record, tampered)
    assert main([*argv, str(tampered), "--out", str(tmp_path / "d")]) == differs
    assert "NOT VERIFIED" in capsys.readouterr().out
    missing = str(tmp_path / "nothing.pt")
    assert main([*argv, missing, "--out", str(tmp_path / "e")]) == bad_input
    assert "no such recorded batch" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
