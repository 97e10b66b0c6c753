"""Checkpoints in one process: atomic replacement (a SIGKILL mid-save keeps the old file), round trip, and the
weights_only safety. The multi-rank resume test is tests/parallel/test_checkpoint.py."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ringtrain.torch.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _model(fill):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
        model[1].running_mean.fill_(fill)
    return model


def test_round_trip_restores_model_optimizer_and_extra(tmp_path):
    model = _model(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # SGD: Adam's first step imports slowly
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    assert save_checkpoint(path, model, opt, epoch=3, note="x", history=[1.0, 2.0]) == path

    fresh = _model(0.0)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.9, momentum=0.5)
    extra = load_checkpoint(path, fresh, fresh_opt)
    assert extra == {"epoch": 3, "note": "x", "history": [1.0, 2.0]}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    state = fresh_opt.state_dict()["state"]
    assert fresh_opt.param_groups[0]["momentum"] == 0.9
    assert torch.equal(state[0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]       # no temporary file left behind


def test_extra_values_torch_load_cannot_read_back_are_refused_at_save(tmp_path):
    class Custom:
        pass
    with pytest.raises(TypeError, match=r"extra\['state'\]\['obj'\] is a Custom"):
        save_checkpoint(tmp_path / "c.pt", _model(1.0), None, state={"obj": Custom()})
    assert not list(tmp_path.iterdir())


def test_load_refuses_pickled_code(tmp_path):
    """weights_only=True: a file carrying an arbitrary object does not get unpickled."""
    path = tmp_path / "evil.pt"
    torch.save({"format": "ringtrain.checkpoint/1", "model": {}, "optimizer": None, "extra": {"x": _Evil()}}, path)
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_checkpoint(path, _model(1.0))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_not_a_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"weights": torch.ones(2)}, path)
    with pytest.raises(ValueError, match="not a ringtrain checkpoint"):
        load_checkpoint(path, _model(1.0))


SLOW_SAVE = textwrap.dedent("""
    import sys, time, torch
    import ringtrain.torch.checkpoint as ckpt
    path = sys.argv[1]
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ckpt.save_checkpoint(path, model, None, version=1)

    real_save = torch.save
    def slow_save(obj, f):          # writes part of the data, then hangs: the test kills us here
        f.write(b"PARTIAL" * 1000)
        f.flush()
        print("WRITING", flush=True)
        time.sleep(60)
        real_save(obj, f)
    torch.save = slow_save
    with torch.no_grad():
        model.weight.fill_(2.0)
    ckpt.save_checkpoint(path, model, None, version=2)
    print("SAVED v2", flush=True)
""")


def test_sigkill_during_save_leaves_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "ckpt.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", line
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    # the kill really hit mid-write: a partial temporary file is there, next to the untouched checkpoint
    leftovers = [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert leftovers and leftovers[0].name.startswith(".ckpt.pt.") and b"PARTIAL" in leftovers[0].read_bytes()
    model = torch.nn.Linear(4, 3)
    assert load_checkpoint(path, model) == {"version": 1}
    assert torch.equal(model.weight, torch.ones(3, 4))


def test_failed_write_keeps_old_file_and_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _model(1.0), None, version=1)
    before = path.read_bytes()

    def broken_save(obj, f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(path, _model(2.0), None, version=2)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
