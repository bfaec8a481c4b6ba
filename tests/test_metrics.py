"""Metrics after a crash and on resume (no step logged twice), Weights & Biases when asked, the run record's rules."""

import json
import sys
import types

import pytest

from ulysses_jax.train import runconfig
from ulysses_jax.train.metrics import MetricsLogger, log_eval, tensorboard_command


def test_continuing_drops_records_after_the_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=5, progress=False)
    for step in range(1, 5):
        log.log({"step": step, "loss": 1.0 / step, "eval_loss": 2.0})
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # a line cut short by a kill
    log = MetricsLogger(tmp_path, total_steps=5, first_step=2, progress=False)  # continues from checkpoint 2
    for step in (3, 4, 5):
        log.log({"step": step, "loss": 0.5})
    log.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_tensorboard_hides_the_steps_logged_after_the_checkpoint(tmp_path):
    """A run continued from step 1 starts its event file with a session START at step 1 (tensorboardX's purge_step):
    TensorBoard then drops every earlier event, and the file holds the kept steps again (metrics.jsonl's: what a
    killed run's writer never wrote is not lost)."""
    log = MetricsLogger(tmp_path, total_steps=3, progress=False)
    log.log({"step": 1, "loss": 1.0})
    log.close()
    log = MetricsLogger(tmp_path, total_steps=3, first_step=1, progress=False)
    assert log._tb is not None
    log.close()
    files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    from tensorboardX.proto import event_pb2

    def events(path):
        data, out, i = path.read_bytes(), [], 0
        while i < len(data):
            n = int.from_bytes(data[i:i + 8], "little")
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12:i + 12 + n])
            out.append(ev)
            i += 12 + n + 4
        return out

    starts = [e for e in events(files[1]) if e.HasField("session_log")]
    assert starts and starts[0].session_log.status == event_pb2.SessionLog.START and starts[0].step == 1
    kept = [(e.step, v.simple_value) for e in events(files[1]) for v in e.summary.value if v.tag == "train/loss"]
    assert kept == [(1, 1.0)]


def test_wandb_logging_when_asked(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(tmp_path / "run", total_steps=2, progress=False, wandb_project="proj", wandb_id="abc",
                        config={"steps": 2})
    log.log({"step": 1, "loss": 2.5, "mfu": None, "eval_loss": 3.0})
    log.close()
    assert calls[0][0] == "init" and calls[0][1]["project"] == "proj" and calls[0][1]["id"] == "abc"
    assert calls[0][1]["resume"] == "allow" and calls[0][1]["config"] == {"steps": 2}
    assert calls[1] == ("log", 1, {"train/loss": 2.5, "eval/loss": 3.0}) and calls[2] == ("finish",)


def test_eval_result_written_to_the_run(tmp_path):
    path = log_eval(tmp_path, {"step": 4, "loss": 2.0, "perplexity": 7.39})
    assert json.loads(path.read_text())["step"] == 4 and list((tmp_path / "tensorboard").iterdir())


def test_tensorboard_command_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name))
    want = "pip install tensorboard, then: tensorboard --logdir runs/x/tensorboard"
    assert tensorboard_command("runs/x/tensorboard") == want


def test_config_values_are_checked(tmp_path):
    from ulysses_jax.train.config import TrainConfig

    base = TrainConfig()
    cfg = runconfig.apply(base, {"seq-len": 512, "data": "a.jsonl", "mesh": {"sp": 4}, "optim": {"lr": 1}}, where="f")
    assert cfg.seq_len == 512 and cfg.data == ("a.jsonl",) and cfg.mesh.sp == 4 and cfg.optim.lr == 1.0
    for values, message in [
        ({"seq_len": "long"}, "f: seq_len is 'long', not an integer"),
        ({"attention": "fast"}, "f: attention is 'fast', not 'auto' or 'xla' or 'blockwise' or 'pallas' or 'cudnn'"),
        ({"mesh": 8}, "f: mesh must be a mapping"),
        ({"mesh": {"spp": 2}}, "f: unknown setting 'mesh.spp'; did you mean 'sp'?"),
        ({"resume": "yes"}, "f: resume is 'yes', not true or false"),
        ({"remat": 3}, "f: remat is 3, not 'none' or 'full' or 'save_matmuls' or 'offload' or null"),
    ]:
        with pytest.raises(ValueError) as e:
            runconfig.apply(base, values, where="f")
        assert message in str(e.value)
    back = runconfig.apply(base, runconfig.to_dict(cfg), where="f")
    assert back == cfg
