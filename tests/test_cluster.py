"""Several processes as schedulers start them (train/cluster.py, experiments/launch/): SLURM's and Kubernetes' variables
read without coordinator flags, the launch recipes run as written, a lost process ends the job with one line, and a
checkpoint cut short between the processes' writes is never the resume point.

Two processes on this machine, 4 fake CPU devices each (gloo collectives), stand for two nodes.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from ulysses_jax.train.cluster import EXIT_PEER_LOST, SLURM_PORT_BASE, first_node, launch_settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "experiments" / "launch"
TINY = ["--preset", "tiny", "--seq-len", "256", "--batch-size", "2", "--mesh.fsdp", "2", "--mesh.sp", "4",
        "--checkpoint-every", "1", "--cpu-devices", "4", "--attention", "xla", "--no-progress"]


# ------------------------------------------------------------------------------------ reading the environment


def test_slurm_variables():
    env = {"SLURM_JOB_ID": "123456", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
           "SLURM_STEP_NODELIST": "gpu[007-010]", "SLURM_STEP_TASKS_PER_NODE": "1(x4)"}
    got = launch_settings(env)
    assert got.coordinator == f"gpu007:{SLURM_PORT_BASE + 123456 % 4096}"
    assert (got.num_processes, got.process_id, got.source) == (4, 2, "SLURM")
    assert got.local_device_ids is None  # one task per node: every GPU of the node
    two = launch_settings({**env, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "1",
                           "JAX_COORDINATOR_PORT": "7000"})
    assert two.local_device_ids == (1,) and two.coordinator == "gpu007:7000"  # several tasks a node: one GPU each
    assert [first_node(x) for x in ("n1", "n1,n2", "gpu[003-010,012],io1", "a-b[1,4]")] == [
        "n1", "n1", "gpu003", "a-b1"]


def test_kubernetes_variables():
    env = {"JAX_COORDINATOR_ADDRESS": "train-0.train:62000", "JAX_NUM_PROCESSES": "2", "JOB_COMPLETION_INDEX": "1"}
    got = launch_settings(env)
    assert (got.coordinator, got.num_processes, got.process_id, got.source) == ("train-0.train:62000", 2, 1,
                                                                               "Kubernetes")
    assert launch_settings({}) is None
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        launch_settings({k: v for k, v in env.items() if k != "JAX_NUM_PROCESSES"})
    with pytest.raises(ValueError, match="SLURM_PROCID='x'"):
        launch_settings({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "x", "SLURM_LOCALID": "0",
                         "SLURM_STEP_NODELIST": "n1"})


def test_distributed_outside_a_scheduler_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "JOB_COMPLETION"))}
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "-m", "ulysses_jax", "train", *TINY, "--distributed", "--run-dir",
                        str(tmp_path / "r")], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: --distributed: no SLURM task"), p.stderr[-2000:]
    assert len(p.stderr.splitlines()) == 1 and not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------ two processes


def _free_slurm_job_id() -> int:
    """A job id whose coordinator port (SLURM_PORT_BASE + id mod 4096) is free here."""
    for _ in range(200):
        job = int.from_bytes(os.urandom(2), "little") % 4096 + 4096
        with socket.socket() as s:
            try:
                s.bind(("localhost", SLURM_PORT_BASE + job % 4096))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port for the coordinator")


def _base_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith(("SLURM_", "JAX_COORDINATOR", "JOB_COMPLETION"))}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def slurm_task_env(job: int, i: int, n: int = 2) -> dict:
    """What srun gives task ``i`` of ``n``, one task per node (both nodes are this machine)."""
    return {**_base_env(), "SLURM_JOB_ID": str(job), "SLURM_NTASKS": str(n), "SLURM_PROCID": str(i),
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(i), "SLURM_STEP_NODELIST": "localhost",
            "SLURM_STEP_NUM_NODES": str(n), "SLURM_STEP_TASKS_PER_NODE": f"1(x{n})", "SLURM_JOB_NODELIST": "localhost"}


def start_slurm(run_dir, *args, prelude: str = ""):
    """Two tasks with srun's variables and `train --distributed` (no coordinator flag). ``prelude``: Python run first
    in each task (the test's fault injection)."""
    job = _free_slurm_job_id()
    entry = ["-c", f"import sys\n{prelude}\nfrom ulysses_jax.cli import main\nsys.exit(main(sys.argv[1:]))"]
    return [subprocess.Popen([sys.executable, *entry, "train", "--distributed", *TINY, "--run-dir", str(run_dir),
                              *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=slurm_task_env(job, i)) for i in range(2)]


def finish(procs, codes=(0, 0)):
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err), want in zip(procs, outs, codes):
        assert p.returncode == want, f"exit {p.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    return outs


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def wait_for_step(run_dir, step: int, procs, limit: float = 300):
    end = time.monotonic() + limit
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < end:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


def assert_one_line(err: str, lost: int, survivor: int):
    """The survivor's stderr ends with the one line naming the lost process and the resume command; no Python
    traceback, no C++ stack trace."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and "stack trace" not in err and not any(ln.lstrip().startswith("@ 0x")
                                                                         for ln in lines), err[-3000:]
    ours = [ln for ln in lines if ln.startswith("error:")]
    assert len(ours) == 1 and lines[-1] == ours[0], err[-3000:]
    assert ours[0].startswith(f"error: lost process {lost} of 2") and f"process {survivor} stops too" in ours[0]
    assert "--resume" in ours[0]


@pytest.mark.parametrize("lost", [1, 0])
def test_a_lost_process_ends_the_job_with_one_line(tmp_path, lost):
    """kill -9 of one of two processes mid-run: the other exits 69 (not by a signal) within --peer-timeout plus a few
    seconds, its last stderr line naming the lost process and the resume command. Process 1 lost: the watchdog's
    heartbeats find it; process 0 lost (the coordinator): its service closes and the abort JAX's client makes of
    that is turned into the same line."""
    run = tmp_path / "run"
    procs = start_slurm(run, "--steps", "400", "--peer-timeout", "3")
    wait_for_step(run, 1, procs)
    procs[lost].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = procs[1 - lost]
    out, err = survivor.communicate(timeout=120)
    took = time.monotonic() - killed
    procs[lost].communicate()
    assert survivor.returncode == EXIT_PEER_LOST, f"exit {survivor.returncode}\n{err[-3000:]}"
    assert took < 3 + 10, took  # --peer-timeout, a heartbeat interval, the verdict's hand-over
    assert_one_line(err, lost, 1 - lost)


# ------------------------------------------------------------------------------------ a process that fails

NO_SPACE_AT_STEP_2 = """
import errno, os, time
from ulysses_jax.train import checkpoint
_save = checkpoint.Checkpointer.save
def save(self, step, state, data_state):
    if step == 2 and os.environ["SLURM_PROCID"] == os.environ["FAIL_PROCESS"]:
        (self.directory.parent / "failed_at").write_text(str(time.time()))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory / "2"))
    _save(self, step, state, data_state)
checkpoint.Checkpointer.save = save
"""


def ends(procs) -> list[float]:
    """When each process exits (time.time()), reading their output meanwhile."""
    import threading

    outs, at = [None] * len(procs), [None] * len(procs)

    def wait(i):
        outs[i] = procs[i].communicate(timeout=300)
        at[i] = time.time()

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs, at


@pytest.mark.parametrize("failed", [pytest.param(1, marks=pytest.mark.slow), 0])  # 29 s each: one in the default suite
def test_a_failed_process_ends_the_job_with_one_line(tmp_path, failed):
    """One process's checkpoint write fails (ENOSPC, test-only fault injection in Checkpointer.save at step 2) while
    the other goes on into the next step's collectives: the failed process exits as before (1, its traceback); the
    other exits 69, not by a signal, within 2 x --peer-timeout of the failure, its last stderr line naming the failed
    process and the error's first line. Before, it waited 300 s in a collective, then both aborted (SIGABRT)."""
    run, timeout = tmp_path / "run", 3
    env_fail = {"FAIL_PROCESS": str(failed)}
    job = _free_slurm_job_id()
    entry = ["-c", f"import sys\n{NO_SPACE_AT_STEP_2}\nfrom ulysses_jax.cli import main\nsys.exit(main(sys.argv[1:]))"]
    procs = [subprocess.Popen([sys.executable, *entry, "train", "--distributed", *TINY, "--run-dir", str(run),
                               "--steps", "4", "--peer-timeout", str(timeout)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**slurm_task_env(job, i), **env_fail})
             for i in range(2)]
    outs, at = ends(procs)
    peer = 1 - failed
    err = outs[peer][1]
    assert procs[failed].returncode == 1 and "OSError: [Errno 28] No space left on device" in outs[failed][1], (
        procs[failed].returncode, outs[failed][1][-3000:])
    assert procs[peer].returncode == EXIT_PEER_LOST, f"exit {procs[peer].returncode}\n{err[-3000:]}"
    took = max(at) - float((run / "failed_at").read_text())
    assert took < 2 * timeout, took
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and "stack trace" not in err and "bad_cast" not in err, err[-3000:]
    ours = [ln for ln in lines if ln.startswith("error:")]
    assert len(ours) == 1 and lines[-1] == ours[0], err[-3000:]
    assert ours[0].startswith(f"error: process {failed} of 2") and (
        "failed: OSError: [Errno 28] No space left on device: ") in ours[0], ours[0]
    assert f"process {peer} stops too" in ours[0] and "last complete checkpoint, step 1" in ours[0]


NO_SPACE_IN_THE_BACKGROUND_AT_STEP_2 = """
import errno, os, time
from orbax.checkpoint._src.serialization import serialization
from ulysses_jax.train import checkpoint
_save, _write, _now = checkpoint.Checkpointer.save, serialization.async_serialize_from_host, [None]
def save(self, step, state, data_state):
    _now[0] = self.directory.parent if step == 2 and os.environ["SLURM_PROCID"] == "1" else None
    _save(self, step, state, data_state)
async def write(*args, **kwargs):  # Orbax's background write of an array (a private function: test-only injection)
    if _now[0] is not None:
        (_now[0] / "failed_at").write_text(str(time.time()))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "params/layers.0.w")
    return await _write(*args, **kwargs)
checkpoint.Checkpointer.save, serialization.async_serialize_from_host = save, write
"""


@pytest.mark.slow
def test_a_failed_background_write_ends_the_job_with_one_line(tmp_path):
    """Process 1's part of checkpoint 2 fails in Orbax's background writer (ENOSPC; test-only fault injection): the
    main threads go on, and Orbax's background threads wait at two different barriers for its timeout (20 minutes).
    The barrier meets the error first (checkpoint._telling_barrier): process 0 exits 69 with the line naming process
    1 and the error, process 1 exits 1 once its cleanup is given up, both within 2 x --peer-timeout."""
    run, timeout = tmp_path / "run", 3
    procs = start_slurm(run, "--steps", "4", "--peer-timeout", str(timeout),
                        prelude=NO_SPACE_IN_THE_BACKGROUND_AT_STEP_2)
    outs, at = ends(procs)
    assert procs[1].returncode == 1 and procs[0].returncode == EXIT_PEER_LOST, [(p.returncode, e[-2000:])
                                                                                for p, (_, e) in zip(procs, outs)]
    assert max(at) - float((run / "failed_at").read_text()) < 2 * timeout
    ours = [ln for ln in outs[0][1].splitlines() if ln.startswith("error:")]
    assert len(ours) == 1 and ours[0].startswith("error: process 1 of 2") and (
        "failed: OSError: [Errno 28] No space left on device: 'params/layers.0.w'") in ours[0], outs[0][1][-3000:]
    last = outs[1][1].strip().splitlines()[-1]
    assert last.startswith("error: OSError: [Errno 28] No space left on device"), outs[1][1][-3000:]


REFUSED_ON_PROCESS_1_AT_STEP_2 = """
import os
from ulysses_jax.train import run_loop, trainer
# as cuDNN's packed attention would bound the documents per row (the setup's checks and the loop's)
trainer.documents_limit = run_loop.documents_limit = lambda *a, **k: 4
_calls = [0]
def check(batch, limit):  # this process's verdict on its own rows: process 1's rows of step 2 hold too many
    _calls[0] += 1
    if _calls[0] == 2 and os.environ["SLURM_PROCID"] == "1":
        raise ValueError(f"a row holds 9 documents, more than --attn-max-documents {limit} lets cuDNN's packed "
                         f"attention describe; raise --attn-max-documents or use --attention pallas")
run_loop.check_documents_per_row = check
"""


def test_a_batch_refused_on_one_process_is_refused_on_every_one(tmp_path):
    """The rows of one process (here process 1's at step 2; its verdict injected, as on CPU no kernel bounds the
    documents per row) hold more documents than the step was compiled for: the verdict is taken for the whole batch,
    so both processes exit 2 with the same one line naming process 1 and its rows, and neither waits for the other."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    outs = finish(start_slurm(run, "--steps", "4", "--peer-timeout", "3", prelude=REFUSED_ON_PROCESS_1_AT_STEP_2),
                  codes=(2, 2))
    assert time.monotonic() - t0 < 200
    want = ("error: process 1 of 2 (rows 1 of the global batch): a row holds 9 documents, more than "
            "--attn-max-documents 4")
    for out, err in outs:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(want), err[-3000:]
    assert sorted(losses(run)) == [1]


# ------------------------------------------------------------------------------------ restarts equal a straight run

STEPS = "6"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run: two SLURM tasks, 6 steps."""
    run = tmp_path_factory.mktemp("straight") / "run"
    finish(start_slurm(run, "--steps", STEPS))
    return losses(run)


@pytest.mark.slow
def test_killed_task_restarted_equals_uninterrupted_bit_for_bit(tmp_path, straight):
    """SLURM's variables alone: train, kill -9 process 1 after step 3, the survivor exits 69 with the line; the same
    command with --resume continues from the last complete checkpoint; every step's loss equals the uninterrupted
    run's exactly (same processes, same mesh: the same computation on CPU)."""
    run = tmp_path / "run"
    procs = start_slurm(run, "--steps", STEPS, "--peer-timeout", "5")
    wait_for_step(run, 3, procs)
    procs[1].send_signal(signal.SIGKILL)
    _, err = procs[0].communicate(timeout=120)
    procs[1].communicate()
    assert procs[0].returncode == EXIT_PEER_LOST
    assert_one_line(err, 1, 0)
    finish(start_slurm(run, "--steps", STEPS, "--resume"))
    assert losses(run) == straight


KILL_BETWEEN_WRITES = """
import os, signal
from ulysses_jax.train import checkpoint
_save = checkpoint.Checkpointer.save
def save(self, step, state, data_state):
    _save(self, step, state, data_state)  # this process's arrays handed to Orbax's writer; the commit is to come
    if step == 3 and os.environ["SLURM_PROCID"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.Checkpointer.save = save
"""


@pytest.mark.slow
def test_kill_between_the_processes_writes_resumes_from_the_previous_checkpoint(tmp_path, straight):
    """Process 1 is killed inside the save of step 3 (test-only fault injection, a patched Checkpointer.save), while
    process 0 writes its part: step 3 is never committed (Orbax renames it only once every process has written),
    the resume starts from step 2, and the losses equal the uninterrupted run's."""
    run = tmp_path / "run"
    procs = start_slurm(run, "--steps", STEPS, "--peer-timeout", "5", prelude=KILL_BETWEEN_WRITES)
    out, err = procs[0].communicate(timeout=300)
    procs[1].communicate()
    assert procs[1].returncode == -signal.SIGKILL and procs[0].returncode == EXIT_PEER_LOST, err[-3000:]
    assert_one_line(err, 1, 0)
    ckpts = run / "checkpoints"
    assert sorted(int(c.name) for c in ckpts.iterdir() if c.name.isdigit()) == [1, 2]
    assert "continues from its last complete checkpoint, step 2" in err
    assert list(ckpts.glob("3.*/params*/array_metadatas/process_0"))  # process 0 wrote its part of step 3
    outs = finish(start_slurm(run, "--steps", STEPS, "--resume"))
    assert f"Continuing {run} from step 2" in outs[0][0]
    assert losses(run) == straight


# ------------------------------------------------------------------------------------ the recipes as written

FAKE_SRUN = """#!/bin/bash
# srun for tests: starts SLURM_NNODES tasks of the command on this machine, each with srun's variables
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NTASKS=$SLURM_NNODES SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NODEID=$i SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST \\
  SLURM_STEP_NUM_NODES=$SLURM_NNODES SLURM_STEP_TASKS_PER_NODE="1(x$SLURM_NNODES)" "$@" > "$LOGS/task$i.out" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def sbatch_directives() -> dict:
    lines = (LAUNCH / "slurm.sbatch").read_text().splitlines()
    return dict((d.split("=", 1) + [""])[:2] for d in (ln.removeprefix("#SBATCH ").strip() for ln in lines
                                                       if ln.startswith("#SBATCH ")))


@pytest.mark.parametrize("status", [0, 75, 69])
def test_sbatch_recipe_requeues_a_run_stopped_by_its_time_limit(tmp_path, status):
    """experiments/launch/slurm.sbatch with stand-ins for srun (exits ``status``) and scontrol: it activates $VENV,
    asks for SIGTERM 120 s before --time and to be requeueable, and requeues the job when `train` stopped on that
    signal with a checkpoint saved (75); any other status is the job's, without a requeue."""
    got = sbatch_directives()
    assert got["--signal"] == "TERM@120" and "--requeue" in got and got["--open-mode"] == "append"
    assert {"--time", "--partition", "--account"} <= set(got) and got["--ntasks-per-node"] == "1"
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{bin_dir}:$PATH"; export ACTIVATED=yes\n')
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $ACTIVATED $*" >> "{tmp_path}/calls"; exit {status}\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> "{tmp_path}/calls"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": os.environ["PATH"], "RUN_DIR": str(tmp_path / "run"), "VENV": str(venv), "SLURM_JOB_ID": "4242"}
    p = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--steps", "2"], capture_output=True, text=True, env=env,
                       timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert p.returncode == status, p.stdout + p.stderr
    assert calls[0].startswith("srun yes --ntasks-per-node=1 --kill-on-bad-exit=1 ulysses-jax train --distributed")
    assert calls[1:] == (["scontrol requeue 4242"] if status == 75 else [])


@pytest.mark.slow
def test_sbatch_recipe_trains_and_resumes(tmp_path):
    """experiments/launch/slurm.sbatch as written, with an srun that starts its two tasks here: the first submission
    trains 2 steps, the same submission again (the script adds --resume) continues to 3."""
    bin_dir, logs, run = tmp_path / "bin", tmp_path / "logs", tmp_path / "run"
    bin_dir.mkdir()
    logs.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = _base_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", LOGS=str(logs), RUN_DIR=str(run),
               SLURM_JOB_ID=str(_free_slurm_job_id()), SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost")
    for steps in ("2", "3"):
        p = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), *TINY, "--steps", steps], capture_output=True,
                           text=True, env=env, timeout=600)
        tasks = [(logs / f"task{i}.out").read_text() for i in range(2)]
        assert p.returncode == 0, p.stderr + "\n".join(t[-2000:] for t in tasks)
        assert "Job: process 0 of 2 (SLURM" in tasks[0] and "running on 8 fake CPU devices" in tasks[0]
    assert "Continuing" in tasks[0] and sorted(losses(run)) == [1, 2, 3]


@pytest.mark.slow
def test_kubernetes_recipe_resumes_a_one_process_run_on_two(tmp_path):
    """experiments/launch/k8s-indexed-job.yaml as written (its script and variables, JOB_COMPLETION_INDEX as
    Kubernetes sets it): a run of one 8-device process continues on the Job's two pods (1 -> 2 processes, the same
    global batch and data position) and again (2 -> 2); the losses follow a one-process run's."""
    docs = list(yaml.safe_load_all((LAUNCH / "k8s-indexed-job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    spec = job["spec"]["template"]["spec"]
    assert job["spec"]["completionMode"] == "Indexed" and spec["subdomain"] == docs[0]["metadata"]["name"]
    container = spec["containers"][0]
    variables = {e["name"]: e["value"] for e in container["env"]}
    n = int(variables["JAX_NUM_PROCESSES"])
    assert n == job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert variables["JAX_COORDINATOR_ADDRESS"].startswith(f"{job['metadata']['name']}-0.{spec['subdomain']}:")
    run = tmp_path / "run"
    single = [sys.executable, "-m", "ulysses_jax", "train", *TINY, "--cpu-devices", "8", "--optim.decay-steps", "4",
              "--optim.warmup-steps", "1"]
    p = subprocess.run([*single, "--steps", "2", "--run-dir", str(run)], capture_output=True, text=True,
                       env=_base_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for steps in ("4", "5"):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        env = {**_base_env(), **variables, "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "RUN_DIR": str(run),
               "TRAIN_ARGS": " ".join([*TINY, "--steps", steps])}
        procs = [subprocess.Popen([*container["command"], *container["args"]], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**env, "JOB_COMPLETION_INDEX": str(i)})
                 for i in range(n)]
        outs = finish(procs)
        assert "Job: process 0 of 2 (Kubernetes" in outs[0][0] and "Continuing" in outs[0][0]
    p = subprocess.run([*single, "--steps", "5", "--run-dir", str(tmp_path / "one")],
                       capture_output=True, text=True, env=_base_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = losses(run), losses(tmp_path / "one")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
    for step in want:  # other processes, other reduction order: equal to float32 rounding
        assert abs(got[step] - want[step]) <= 2e-5 * abs(want[step]), (step, got[step], want[step])


if sys.platform != "linux":
    pytestmark = pytest.mark.skip("gloo CPU collectives are tested on Linux only")
