"""fastinit.checkpoint on a model with no TorchRec module, on a host where neither TorchRec nor
fbgemm-gpu can be imported (a GPU host with torch's CUDA build alone ran ``make gpu-check``'s
dense step so, and ``prepare`` failed importing fbgemm-gpu to look for fused tables)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                            world_size=1)
    import fastinit.checkpoint as fc

    gen = torch.Generator().manual_seed(0)  # never the global RNG
    layers = [torch.nn.Linear(256, 256, device="meta"), torch.nn.Linear(256, 8, device="meta")]
    model = torch.nn.Sequential(*layers).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    optim = torch.optim.Adam(model.parameters())

    def step():
        optim.zero_grad()
        model(torch.randn(4, 256, generator=gen)).sum().backward()
        optim.step()

    step()
    fc.prepare(model, {"optim": optim}, background=False)
    for i in range(2):
        step()
        fc.save(f"{sys.argv[1]}/s{i}", model, {"optim": optim}, metadata={"step": i}).wait()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optim.state.values()]
    step()
    report = fc.load(f"{sys.argv[1]}/s1", model, {"optim": optim})
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, optim.state.values()))
    assert report.bytes_read == 0 and report.memory_bytes > 0, report
    fc.close()
    blocked = [m for m in ("torchrec", "fbgemm_gpu") if sys.modules.get(m) is not None]
    print("OK", blocked)
    """
)


def test_a_dense_model_saves_and_loads_where_torchrec_and_fbgemm_cannot_be_imported(tmp_path):
    from fastinit.testing.dist import free_port

    blocker = tmp_path / "blocked"
    for name in ("torchrec", "fbgemm_gpu"):
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked')\n")
    script = tmp_path / "dense.py"
    script.write_text(_SCRIPT)
    # The blocker comes first on the path of this process and of every one it starts (the writer).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "OK []", proc.stdout + proc.stderr
