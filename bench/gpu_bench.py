#!/usr/bin/env python3
"""arserve against PyTorch on one GPU: the timing stage of the first GPU run (issue 35).

    python3 bench/gpu_bench.py --bin KIT/bin --out OUTDIR [--budget-s 240] [--small]
                               [--backend cuda|cpu] [--work DIR] [--threads N]

Needs only what the GPU machine has: python3 with torch, transformers, numpy, safetensors and
tokenizers, the repository's tracked files, and KIT/bin's arserve and speed_bench (built with
CUDA by `make gpu-kit`). No network, no venv. Stages, each in its own process under a timeout:

1. build: the models, generated on the machine. Janus-Pro-1B's shapes (24 layers of 2048, 16
   heads of 128, FFN 5632, the released VQ decoder drawing 384 x 384 pixels; the 64-word golden
   vocabulary) through transformers' JanusForConditionalGeneration, random bf16 weights drawn
   on the GPU, converted by tools/convert/janus.py (bench/ref_janus.py build --layers 24); beside
   it VAR-d16's shapes (tools/make_tiny_model.py --preset var-d16 --dtype bf16, numpy). The same
   process reports the GPU, the versions, and the device's read bandwidth (torch: the sum of a
   2 GiB buffer, best of 5), the roofline's denominator.
2. arserve in-process: speed_bench --backend cuda --json on each model at batch 1, 8 and 32
   (a Janus image is a CFG pair of rows): decode step ms, images/s, the step's share of the
   memory roofline (speed_bench's weight bytes per step over the bandwidth measured in stage 1),
   kernel launches and host-device copies per step and peak device memory where speed_bench
   reports them ("n/a" where not), and the GPU memory nvidia-smi saw in use.
3. the daemon: `arserve serve --backend cuda` on loopback with each model, driven by
   `arserve bench --arrival concurrency` (a closed loop of C clients) at C = 1, 8 and 32:
   images/s and end-to-end latency percentiles.
4. PyTorch, after arserve has exited, in its own process: transformers' Janus on the same
   weights in bf16 (bench/ref_janus.py: generate(generation_mode="image"), its static cache, CFG
   and sampler with arserve.json's settings, then its VQ decoder) at batch 1, 8 and 32, eager;
   then in another process the same with the decode step's forward compiled by torch.compile
   (mode "reduce-overhead": CUDA graphs; the prompt's forward stays eager). Compiling needs no
   network; if it fails the reason is recorded and the run goes on.

A step's time: arserve's is speed_bench's median decode step (a step returns after its logits
reached the host); PyTorch's is the synchronised time from the second step's generation head to
the end of generate over the steps between (transformers' loop may queue a few steps ahead of
the GPU, so stamps alone would time the launches). images/s counts whole images, the VQ decode
included, on both sides. VAR has no PyTorch side (the issue asks for transformers' Janus).

Order of precedence when --budget-s is short: the build, arserve's Janus at batch 1 and 8, VAR
at 1, 8 and 32, the daemon on each model (one wave of C requests at each C; two with --small),
PyTorch eager; then, with what is left, PyTorch compiled (a timeout keeps the batches it
finished) and arserve's Janus at batch 32 in-process (speed_bench's run for it first makes 32
images at batch 1: about a minute; the daemon at C = 32 has that batch already). A stage that
would not fit is skipped, saying so; every stage's process gets at most the time left less
what the stages after it need at least. Writes OUTDIR/timing.json (every figure, the GPU, the versions,
each stage's seconds), OUTDIR/timing.md (the tables) and OUTDIR/timing.log (the processes'
output), prints the tables and each stage's seconds. Exit status 0 when every stage that ran
passed (a skipped stage or a failed torch.compile does not count), 1 when one failed, 2 for a
usage error (no GPU, --bin lacking a binary).

`--small` runs the same pipeline at toy shapes (the golden Janus model's 64-wide layers, 8 x 8
tokens; VAR at the tiny model's shapes) on whatever device --backend names: `--backend cpu
--small` is tests/bench/test_gpu_bench.py, in `make test`, with the CPU build's binaries.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCHES = (1, 8, 32)
CONCURRENCY = (1, 8, 32)
JANUS_STEPS_FULL = 576
# Keys speed_bench --backend cuda adds to each batch row (and copies here as they are).
DEVICE_KEYS = ("launches_per_step", "kernels_per_step", "h2d_copies_per_step",
               "d2h_copies_per_step", "copy_bytes_per_step", "device_peak_bytes",
               "graph_launches_per_step", "syncs_per_step")


class StageError(Exception):
    """A stage that failed; the message says why."""


class UsageError(Exception):
    """The run cannot start (no GPU, a binary missing): exit 2, saying why."""


class StageTimeout(StageError):
    """A process that ran past its time; .out holds what it printed before."""

    def __init__(self, msg, out=""):
        super().__init__(msg)
        self.out = out


def log_path(a):
    return os.path.join(a.out, "timing.log")


def append_log(a, title, text):
    with open(log_path(a), "a") as f:
        f.write("==== %s\n%s\n" % (title, text.rstrip()))


def run_proc(a, title, cmd, timeout, env=None):
    """stdout of cmd, which must exit 0 within timeout seconds (its process group is killed
    otherwise: StageTimeout with what it printed); stderr goes to timing.log."""
    if timeout <= 0:
        raise StageTimeout("%s: no time left" % title)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True, cwd=ROOT)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p)
        out, err = p.communicate()
        append_log(a, "%s (killed after %.0f s): %s" % (title, timeout, " ".join(cmd)),
                   (out or "") + (err or ""))
        raise StageTimeout("%s: still running after %.0f s, killed" % (title, timeout), out or "")
    append_log(a, "%s (exit %d): %s" % (title, p.returncode, " ".join(cmd)), (out or "") + (err or ""))
    if p.returncode != 0:
        tail = (err or out or "").strip().splitlines()[-6:]
        raise StageError("%s exited %d: %s" % (title, p.returncode, " | ".join(tail)))
    return out


def kill_group(p, sig=signal.SIGKILL):
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def last_json(text):
    """The last line of text that is a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise StageError("no JSON in the output: %r" % text[-300:])


def json_lines(text):
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


# ---- GPU memory as nvidia-smi sees it ---------------------------------------------------------

class GpuMemory:
    """The largest memory.used nvidia-smi reports while the block runs (MiB, every 100 ms),
    less what was in use before; None without nvidia-smi."""

    def __init__(self, on):
        self.on = on and shutil.which("nvidia-smi") is not None
        self.peak = self.base = None

    @staticmethod
    def used_now():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=10).stdout
            return float(out.split()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def __enter__(self):
        if not self.on:
            return self
        self.base = self.used_now()
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits", "-i", "0", "-lms", "100"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                v = float(line.split()[0])
            except (ValueError, IndexError):
                continue
            self.peak = v if self.peak is None else max(self.peak, v)

    def __exit__(self, *exc):
        if self.on:
            kill_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
            self.thread.join(2)
        return False

    def mib(self):
        if self.peak is None or self.base is None:
            return None
        return max(0.0, self.peak - self.base)


# ---- the driver -------------------------------------------------------------------------------

class Bench:
    def __init__(self, a):
        self.a = a
        self.t0 = time.monotonic()
        self.failed = False
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self.sb_backend_flag = False
        small = a.small
        self.r = {
            "tool": "bench/gpu_bench.py", "format": 1,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "small": small, "backend": a.backend, "budget_s": a.budget_s,
            "batches": list(BATCHES), "concurrency": list(CONCURRENCY),
            "machine": {"hostname": platform.node(), "cpus": os.cpu_count(),
                        "python": platform.python_version()},
            "stages": [], "skipped": [], "models": {},
            "arserve": {"janus": {"speed": {}, "daemon": {}, "speed_graphs_off": {}},
                        "var": {"speed": {}, "daemon": {}}},
            "pytorch": {"janus": {}},
        }
        # The least time each stage needs to say anything (seconds): what the stages after the
        # running one are guaranteed.
        self.floor = ({"speed": 5, "daemon": 5, "torch": 10} if small else
                      {"speed": 25, "daemon": 20, "torch": 40})

    # -- bookkeeping
    def elapsed(self):
        return time.monotonic() - self.t0

    def left(self):
        return self.a.budget_s - self.elapsed()

    def save(self):
        self.r["total_s"] = round(self.elapsed(), 2)
        tmp = os.path.join(self.a.out, "timing.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.r, f, indent=1)
        os.replace(tmp, os.path.join(self.a.out, "timing.json"))

    def say(self, msg):
        print("[%6.1f s] %s" % (self.elapsed(), msg), flush=True)

    def skip(self, name, why):
        self.r["skipped"].append({"stage": name, "why": why})
        self.r["stages"].append({"name": name, "status": "skipped", "seconds": 0, "note": why})
        self.say("%s: skipped: %s" % (name, why))
        self.save()

    def stage(self, name, fn, reserve=0.0, floor=0.0, need=None, optional=False):
        """Runs fn(timeout) as stage `name` unless it would not fit: the time left less
        `reserve` (what later stages need) must cover `floor` and, when known, the predicted
        `need`. A failure marks the run failed unless `optional`."""
        avail = self.left() - reserve
        if avail < floor:
            self.skip(name, "%.0f s left of the budget, %.0f s kept for later stages; needs at "
                      "least %.0f s" % (self.left(), reserve, floor))
            return None
        if need is not None and need > avail:
            self.skip(name, "predicted %.0f s from the figures so far, %.0f s available"
                      % (need, avail))
            return None
        self.say("%s: started (at most %.0f s)" % (name, avail))
        t = time.monotonic()
        entry = {"name": name}
        try:
            out = fn(avail)
            entry["status"] = "ok"
        except StageTimeout as e:
            out = None
            entry.update(status="timeout", note=str(e))
            self.failed |= not optional
        except StageError as e:
            out = None
            entry.update(status="failed", note=str(e))
            self.failed |= not optional
        entry["seconds"] = round(time.monotonic() - t, 2)
        self.r["stages"].append(entry)
        self.say("%s: %s in %.1f s%s" % (name, entry["status"], entry["seconds"],
                                          (": " + entry["note"]) if "note" in entry else ""))
        self.save()
        return out

    # -- preflight
    def preflight(self):
        a = self.a
        for name in ("arserve", "speed_bench"):
            path = os.path.join(a.bin, name)
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                usage_error("--bin %s has no executable %s (make gpu-kit puts arserve and "
                            "speed_bench in KIT/bin; here, make build/arserve build/speed_bench "
                            "and --bin build)" % (a.bin, name))
        self.arserve = os.path.abspath(os.path.join(a.bin, "arserve"))
        self.speed_bench = os.path.abspath(os.path.join(a.bin, "speed_bench"))
        m = self.r["machine"]
        if a.backend == "cuda":
            if not shutil.which("nvidia-smi"):
                usage_error("no GPU: nvidia-smi is not on PATH (--backend cpu --small runs the "
                            "pipeline without one)")
            try:
                q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,"
                                    "driver_version", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.SubprocessError) as e:
                usage_error("no GPU: nvidia-smi failed: %s" % e)
            if q.returncode != 0 or not q.stdout.strip():
                usage_error("no GPU: nvidia-smi says: %s" % (q.stderr or q.stdout).strip()[:300])
            f = [x.strip() for x in q.stdout.strip().splitlines()[0].split(",")]
            m.update(gpu=f[0], gpu_memory_mib=float(f[1]), gpu_memory_used_mib_at_start=float(f[2]),
                     driver=f[3])
            self.find_cublas()
        helptext = subprocess.run([self.speed_bench, "--help"], capture_output=True, text=True,
                                  timeout=30, env=self.env)
        self.sb_backend_flag = "--backend" in helptext.stdout + helptext.stderr
        self.sb_graphs_flag = "--gpu-graphs" in helptext.stdout + helptext.stderr
        if a.backend != "cpu" and not self.sb_backend_flag:
            usage_error("%s has no --backend: it times the CPU backend only (speed_bench "
                        "before --backend cuda); rebuild the kit" % self.speed_bench)
        self.r["speed_bench_backend_flag"] = self.sb_backend_flag
        self.save()

    def find_cublas(self):
        """When the kit's binaries do not resolve cuBLAS, the directories of the machine's
        CUDA or of torch's nvidia wheels that hold it go on LD_LIBRARY_PATH."""
        missing = self.ldd_missing()
        if not missing:
            return
        dirs = []
        for base in sys.path:
            dirs += glob.glob(os.path.join(base, "nvidia", "*", "lib"))
        dirs += glob.glob("/usr/local/cuda*/lib64") + glob.glob("/usr/local/cuda*/targets/*/lib")
        add = [d for d in dirs if any(os.path.exists(os.path.join(d, lib)) for lib in missing)]
        if add:
            self.env["LD_LIBRARY_PATH"] = ":".join(
                add + [p for p in self.env.get("LD_LIBRARY_PATH", "").split(":") if p])
            self.r["machine"]["ld_library_path_added"] = add
        still = self.ldd_missing()
        if still:
            usage_error("%s does not resolve %s (looked in %s)" % (
                self.speed_bench, ", ".join(still), ", ".join(dirs) or "nothing found"))

    def ldd_missing(self):
        missing = set()
        for b in (self.speed_bench, self.arserve):
            try:
                out = subprocess.run(["ldd", b], capture_output=True, text=True, timeout=30,
                                     env=self.env).stdout
            except (OSError, subprocess.SubprocessError):
                return []
            missing |= {line.split()[0] for line in out.splitlines() if "not found" in line}
        return sorted(missing)

    # -- stage 1: the models
    def build(self, timeout):
        a = self.a
        os.makedirs(a.work, exist_ok=True)
        janus_dir, var_dir = os.path.join(a.work, "janus"), os.path.join(a.work, "var")
        for d in (janus_dir, var_dir):
            shutil.rmtree(d, ignore_errors=True)
        var_cmd = [sys.executable, os.path.join(ROOT, "tools", "make_tiny_model.py"),
                   "--preset", "var-tiny" if a.small else "var-d16", "--dtype", "bf16",
                   "--seed", "1", "--out", var_dir]
        var = subprocess.Popen(var_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, cwd=ROOT)
        t = time.monotonic()
        try:
            out = run_proc(a, "build: Janus (transformers) and the environment",
                           [sys.executable, os.path.abspath(__file__), "--stage", "build",
                            "--device", self.device, "--work", janus_dir]
                           + (["--small"] if a.small else []), timeout, self.env)
        finally:
            try:
                var_out, _ = var.communicate(timeout=max(1.0, timeout - (time.monotonic() - t)))
            except subprocess.TimeoutExpired:
                kill_group(var)
                var_out, _ = var.communicate()
                raise StageTimeout("build: tools/make_tiny_model.py still running, killed")
            append_log(a, "build: VAR (exit %d): %s" % (var.returncode, " ".join(var_cmd)), var_out)
        if var.returncode != 0:
            raise StageError("tools/make_tiny_model.py exited %d: %s"
                             % (var.returncode, var_out.strip()[-300:]))
        info = last_json(out)
        self.r["machine"].update(info["machine"])
        if "bandwidth" in info:
            self.r["bandwidth"] = info["bandwidth"]
        with open(os.path.join(var_dir, "arserve.json")) as f:
            vcfg = json.load(f)
        with open(os.path.join(var_dir, "classes.txt")) as f:
            var_prompt = f.readline().strip()
        self.r["models"] = {
            "janus": dict(info["janus"], dir=janus_dir),
            "var": {"dir": var_dir, "name": vcfg["name"], "llm": vcfg["llm"],
                    "scales": vcfg["image"]["scales"], "prompt": var_prompt,
                    "weights_bytes": os.path.getsize(os.path.join(var_dir, "model.safetensors"))},
        }
        return True

    # -- stage 2: arserve in-process
    def speed(self, key, batch, timeout, graphs="on"):
        """speed_bench on `key` at batch 1 and `batch`; graphs "off": the same op by op (a
        device backend's steps not captured into graphs), kept in speed_graphs_off."""
        a, model = self.a, self.r["models"][key]
        cmd = [self.speed_bench, "--model", model["dir"], "--batch", str(batch), "--images",
               str(batch), "--reps", "1", "--threads", str(a.threads), "--json"]
        if self.sb_backend_flag:
            cmd += ["--backend", a.backend]
        if graphs == "off":
            if not self.sb_graphs_flag:
                raise StageError("%s has no --gpu-graphs: rebuild the kit" % self.speed_bench)
            cmd += ["--gpu-graphs", "off"]
        if key == "janus":
            cmd += ["--prompt", model["prompt"]]
        t = time.monotonic()
        with GpuMemory(a.backend == "cuda") as mem:
            out = run_proc(a, "speed_bench %s --batch %d --gpu-graphs %s" % (key, batch, graphs),
                           cmd, timeout, self.env)
        took = time.monotonic() - t
        j = last_json(out)
        rows = {r["batch"]: r for r in j["batches"]}
        dest = self.r["arserve"][key]
        dest.setdefault("speed_runs", []).append(
            {"batch_arg": batch, "graphs": graphs, "seconds": round(took, 2),
             "gpu_mem_mib_nvidia_smi": mem.mib(),
             "head": {k: v for k, v in j.items() if k != "batches"}})
        if graphs == "off":
            for b, row in rows.items():
                dest["speed_graphs_off"][str(b)] = self.speed_row(row, j, mem.mib())
            return took
        if key == "janus" and "cond" in j:
            model["cond"], model["uncond"] = j["cond"], j["uncond"]
        model["kv_mib_per_image"] = j.get("kv_mib_per_image")
        for b, row in rows.items():
            if b == 1 and "1" in dest["speed"]:
                continue  # batch 1 from the first run (every run makes its own)
            dest["speed"][str(b)] = self.speed_row(row, j, mem.mib())
        return took

    def speed_row(self, row, head, mem_mib):
        step_s = row.get("step_s") or 0.0
        out = {"batch": row["batch"], "images_per_s": row["images_per_s"], "step_ms": step_s * 1e3,
               "decode_ms": row.get("decode_s", 0.0) * 1e3,
               "roofline_speed_bench": row.get("roofline"),
               "gpu_mem_mib_nvidia_smi": mem_mib}
        wb = head.get("step_weight_bytes")
        bw = (self.r.get("bandwidth") or {}).get("device_read_bytes_per_s") \
            if self.a.backend == "cuda" else head.get("read_bytes_per_s")
        out["step_weight_bytes"] = wb
        out["roofline"] = wb / bw / step_s if wb and bw and step_s > 0 else None
        for k in DEVICE_KEYS:  # speed_bench --backend cuda's, in the row or the head
            out[k] = row.get(k, head.get(k))
        return out

    def predict_speed32(self, key):
        """Seconds speed_bench --batch 32 would take on `key`, from its --batch 8 run: load and
        overheads as then, 33 images at batch 1 (warm-up included), a wave of 32 at batch 8's
        time per image (an upper bound where batching pays)."""
        d = self.r["arserve"][key]
        s1, s8 = d["speed"].get("1"), d["speed"].get("8")
        runs = [r for r in d.get("speed_runs", []) if r["batch_arg"] == 8 and r["graphs"] == "on"]
        if not (s1 and s8 and runs):
            return None
        t1, t8 = 1 / s1["images_per_s"], 1 / s8["images_per_s"]
        overhead = max(0.0, runs[0]["seconds"] - 9 * t1 - 8 * t8)
        return overhead + 33 * t1 + 32 * t8

    # -- stage 3: the daemon
    def daemon_plan(self, key):
        """[(concurrency, requests)] and the cost function predicting its seconds: at each
        concurrency C, 2C requests (two waves) with --small, C (at least 2) on the GPU."""
        d = self.r["arserve"][key]["speed"]
        ips = {c: (d.get("1") if c == 1 else d.get("8") or d.get("1")) for c in CONCURRENCY}
        waves = 2 if self.a.small else 1
        plan = [(c, max(2, waves * c)) for c in CONCURRENCY]

        def cost(p):
            if not all(ips[c] for c, _ in p):
                return None
            return sum(n / ips[c]["images_per_s"] for c, n in p)
        return plan, cost

    def daemon(self, key, timeout):
        a, model = self.a, self.r["models"][key]
        deadline = time.monotonic() + timeout
        plan, cost = self.daemon_plan(key)
        load_s = self.r["arserve"][key].get("speed_runs", [{}])[0].get("seconds", 10.0) or 10.0
        budget = timeout - min(load_s, 60) - 5
        c_pred = cost(plan)
        if c_pred is not None and c_pred > budget:  # one wave each
            plan = [(c, max(2, c)) for c in CONCURRENCY]
            c_pred = cost(plan)
            while c_pred is not None and c_pred > budget and len(plan) > 1:
                self.r["skipped"].append({"stage": "daemon %s C=%d" % (key, plan[-1][0]),
                                          "why": "predicted not to fit the stage's %.0f s"
                                          % timeout})
                plan = plan[:-1]
                c_pred = cost(plan)
        kv = model.get("kv_mib_per_image") or (300 if key == "janus" else 100)
        pool = int(math.ceil(kv * max(CONCURRENCY) * 1.15)) + 16
        port = free_port()
        url = "http://127.0.0.1:%d" % port
        cmd = [self.arserve, "serve", "--model", model["dir"], "--host", "127.0.0.1", "--port",
               str(port), "--backend", a.backend, "--threads", str(a.threads),
               "--max-running", str(max(CONCURRENCY)), "--max-waiting", str(4 * max(CONCURRENCY)),
               "--kv-pool-mb", str(pool), "--drain-timeout-s", "5", "--log-level", "warn"]
        logf = tempfile.TemporaryFile(mode="w+")
        results = self.r["arserve"][key]["daemon"]
        with GpuMemory(a.backend == "cuda") as mem:
            d = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                 start_new_session=True, cwd=ROOT)
            try:
                t = time.monotonic()
                wait_ready(url, d, deadline, logf)
                self.r["arserve"][key]["daemon_load_s"] = round(time.monotonic() - t, 2)
                with tempfile.TemporaryDirectory() as tmp:
                    for c, n in plan:
                        left = deadline - time.monotonic()
                        run_proc(a, "arserve bench %s C=%d" % (key, c),
                                 [self.arserve, "bench", "--url", url, "--arrival", "concurrency",
                                  "--concurrency", str(c), "-n", str(n), "--prompt",
                                  model["prompt"], "--no-progress", "--scrape-interval", "0",
                                  "--timeout", str(max(1, int(left))), "-o", tmp, "--label",
                                  "c%d" % c], left, self.env)
                        with open(os.path.join(tmp, "c%d.json" % c)) as f:
                            j = json.load(f)
                        results[str(c)] = {
                            "concurrency": c, "requests": n, "completed": j.get("completed"),
                            "failed": j.get("num_failed"), "images_per_s": j.get("images_per_s"),
                            "duration_s": j.get("duration"),
                            **{k: j.get(k) for k in ("mean_e2el_ms", "median_e2el_ms",
                                                      "p90_e2el_ms", "p99_e2el_ms",
                                                      "median_queue_ms", "median_step_ms")}}
                        self.save()
                        if j.get("num_failed"):
                            raise StageError("arserve bench C=%d: %d of %d requests failed: %s" % (
                                c, j["num_failed"], n, json.dumps(j.get("failed"))))
            finally:
                stop_daemon(d)
                logf.seek(0)
                append_log(a, "arserve serve %s: %s" % (key, " ".join(cmd)), logf.read())
        self.r["arserve"][key]["daemon_gpu_mem_mib_nvidia_smi"] = mem.mib()
        self.r["arserve"][key]["daemon_kv_pool_mib"] = pool
        return True

    # -- stage 4: PyTorch
    def torch(self, mode, timeout):
        a, model = self.a, self.r["models"]["janus"]
        cmd = [sys.executable, os.path.abspath(__file__), "--stage", "torch", "--mode", mode,
               "--device", self.device, "--work", model["dir"], "--threads",
               str(a.threads or os.cpu_count() or 1)]
        if "cond" in model:
            cmd += ["--cond", json.dumps(model["cond"]), "--uncond", json.dumps(model["uncond"])]
        dest = self.r["pytorch"]["janus"].setdefault(mode, {"batches": {}})
        with GpuMemory(self.device == "cuda") as mem:
            try:
                out = run_proc(a, "PyTorch %s" % mode, cmd, timeout, self.env)
                err = None
            except StageTimeout as e:
                out, err = e.out, e
            except StageError as e:
                out, err = "", e
        for line in json_lines(out):
            if "batch" in line:
                dest["batches"][str(line["batch"])] = line
            else:
                dest.update(line)
        dest["gpu_mem_mib_nvidia_smi"] = mem.mib()
        if err is not None:
            dest["error"] = str(err)
            self.save()
            raise err
        return True

    # -- the whole run
    def run(self):
        a, f = self.a, self.floor
        self.device = "cuda" if a.backend == "cuda" else "cpu"
        self.preflight()
        self.say("gpu_bench: %s backend, budget %.0f s, %s shapes, models in %s" % (
            a.backend, a.budget_s, "toy" if a.small else "Janus-Pro-1B and VAR-d16", a.work))
        core_after_build = 3 * f["speed"] + 2 * f["daemon"] + f["torch"]
        if not self.stage("build", self.build, reserve=core_after_build, floor=10):
            self.finish()
            return
        self.stage("arserve janus batch 1, 8", lambda t: self.speed("janus", 8, t),
                   reserve=2 * f["speed"] + 2 * f["daemon"] + f["torch"], floor=f["speed"])
        self.stage("arserve var batch 1, 8", lambda t: self.speed("var", 8, t),
                   reserve=f["speed"] + 2 * f["daemon"] + f["torch"], floor=f["speed"])
        self.stage("arserve var batch 32", lambda t: self.speed("var", 32, t),
                   reserve=2 * f["daemon"] + f["torch"], floor=f["speed"],
                   need=self.predict_speed32("var"))
        self.stage("daemon janus", lambda t: self.daemon("janus", t),
                   reserve=f["daemon"] + f["torch"], floor=f["daemon"])
        self.stage("daemon var", lambda t: self.daemon("var", t), reserve=f["torch"],
                   floor=f["daemon"])
        self.stage("pytorch eager", lambda t: self.torch("eager", t), floor=f["torch"])
        # The same card op by op: what capturing each step into a graph bought.
        self.stage("arserve janus batch 1, 8, graphs off",
                   lambda t: self.speed("janus", 8, t, graphs="off"), floor=f["speed"],
                   optional=True)
        # The extras, with what is left: PyTorch with CUDA graphs (the fairer baseline for a
        # server that replays them; compiling takes a minute or two), then arserve's Janus at
        # batch 32 in-process (the daemon at C=32 has it already, less precisely).
        if self.device == "cuda" or a.torch_compile == "on":
            self.stage("pytorch compiled", lambda t: self.torch("compiled", t),
                       floor=f["torch"] if a.small else 1.5 * f["torch"], optional=True)
        else:
            self.skip("pytorch compiled", "torch.compile's CUDA graphs need a GPU "
                      "(--torch-compile on compiles on the CPU anyway)")
        self.stage("arserve janus batch 32", lambda t: self.speed("janus", 32, t),
                   floor=f["speed"], need=self.predict_speed32("janus"))
        self.finish()

    def finish(self):
        self.save()
        md = markdown(self.r)
        with open(os.path.join(self.a.out, "timing.md"), "w") as f:
            f.write(md)
        print()
        print(md)
        if not self.a.keep_models and self.a.work_is_temp:
            shutil.rmtree(self.a.work, ignore_errors=True)


def usage_error(msg):
    raise UsageError(msg)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, deadline, logf):
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            logf.seek(0)
            raise StageError("the daemon exited %d: %s" % (proc.returncode, logf.read()[-1500:]))
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    raise StageTimeout("the daemon was not ready in time")


def stop_daemon(d):
    if d.poll() is None:
        kill_group(d, signal.SIGTERM)
        try:
            d.wait(30)
        except subprocess.TimeoutExpired:
            kill_group(d)
            d.wait(10)


# ---- the report -------------------------------------------------------------------------------

def fmt(v, spec="%.2f", none="n/a"):
    return none if v is None else spec % v


def ratio(x, y):
    return "%.2fx" % (x / y) if x and y else "n/a"


def mib(b):
    return None if b is None else b / 2**20


def markdown(r):
    m, L = r.get("machine", {}), []
    gpu = m.get("gpu") or ("CPU (%s cores)" % m.get("cpus"))
    L.append("# arserve against PyTorch%s" % (" (toy shapes: --small)" if r["small"] else ""))
    L.append("")
    bw = (r.get("bandwidth") or {}).get("device_read_bytes_per_s")
    L.append("%s, backend %s; torch %s, transformers %s, CUDA %s, driver %s; device read "
             "bandwidth %s GB/s; %s." % (
                 gpu, r["backend"], m.get("torch", "?"), m.get("transformers", "?"),
                 m.get("torch_cuda") or "none", m.get("driver", "n/a"), fmt(bw and bw / 1e9, "%.0f"),
                 r.get("started", "")))
    L.append("")
    mj = r.get("models", {}).get("janus", {})
    L.append("## %s: arserve (speed_bench, in-process) and PyTorch (transformers' Janus, bf16)"
             % mj.get("name", "Janus"))
    L.append("")
    L.append("Step: one decode step of the batch (both CFG rows of every image). images/s: whole "
             "images, VQ decode included. Ratio: arserve over PyTorch (above 1: arserve faster).")
    L.append("")
    L.append("| batch | arserve step ms | eager step ms | ratio | compiled step ms | ratio | "
             "arserve images/s | eager images/s | ratio | compiled images/s | ratio |")
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ours = r["arserve"]["janus"]["speed"]
    pt = r["pytorch"]["janus"]
    eg = pt.get("eager", {}).get("batches", {})
    co = pt.get("compiled", {}).get("batches", {})
    for b in BATCHES:
        o, e, c = ours.get(str(b), {}), eg.get(str(b), {}), co.get(str(b), {})
        L.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            b, fmt(o.get("step_ms")), fmt(e.get("step_ms")), ratio(e.get("step_ms"), o.get("step_ms")),
            fmt(c.get("step_ms")), ratio(c.get("step_ms"), o.get("step_ms")),
            fmt(o.get("images_per_s")), fmt(e.get("images_per_s")),
            ratio(o.get("images_per_s"), e.get("images_per_s")),
            fmt(c.get("images_per_s")), ratio(o.get("images_per_s"), c.get("images_per_s"))))
    warm = co and ", ".join("%.0f s at batch %s" % (co[b]["warmup_s"], b) for b in co)
    if warm:
        cs = pt["compiled"].get("compile_stats", {})
        L.append("")
        L.append("PyTorch compiled: the warm-up before each batch's timed run (8 steps: compiling "
                 "and recording CUDA graphs) took %s; %s graph breaks, CUDA graphs skipped %s "
                 "times (timing.json: compile_stats)." % (
                     warm, cs.get("graph_breaks", "?"), cs.get("cudagraph_skips", "?")))
    for mode in ("eager", "compiled"):
        if pt.get(mode, {}).get("error"):
            L.append("")
            L.append("PyTorch %s: %s" % (mode, pt[mode]["error"]))
        if pt.get(mode, {}).get("note"):
            L.append("")
            L.append("PyTorch %s: %s" % (mode, pt[mode]["note"]))
    L.append("")
    L.append("## arserve's step on the device")
    L.append("")
    L.append("Roofline: weight bytes a step reads over the read bandwidth measured in this run, "
             "as a share of the step. Launches and copies: per step, from speed_bench. Peak: "
             "speed_bench's device peak; nvidia-smi: the most memory in use while the process ran "
             "(less what was in use before), beside PyTorch's.")
    L.append("")
    L.append("| model | batch | step ms | images/s | VQ ms/image | roofline | launches | "
             "H2D copies | D2H copies | copy KiB | peak MiB | nvidia-smi MiB | PyTorch eager "
             "peak MiB |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key in ("janus", "var"):
        name = r.get("models", {}).get(key, {}).get("name", key)
        for b in BATCHES:
            o = r["arserve"][key]["speed"].get(str(b))
            if not o:
                L.append("| %s | %d | n/a | | | | | | | | | | |" % (name, b))
                continue
            e = eg.get(str(b), {}) if key == "janus" else {}
            L.append("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                name, b, fmt(o["step_ms"]), fmt(o["images_per_s"]), fmt(o["decode_ms"], "%.1f"),
                fmt(o["roofline"] and 100 * o["roofline"], "%.0f%%"),
                fmt(o.get("launches_per_step"), "%.0f"), fmt(o.get("h2d_copies_per_step"), "%.1f"),
                fmt(o.get("d2h_copies_per_step"), "%.1f"),
                fmt(o.get("copy_bytes_per_step") and o["copy_bytes_per_step"] / 1024, "%.1f"),
                fmt(mib(o.get("device_peak_bytes")), "%.0f"),
                fmt(o.get("gpu_mem_mib_nvidia_smi"), "%.0f"),
                fmt(mib(e.get("peak_reserved_bytes")), "%.0f", "" if key != "janus" else "n/a")))
    L.append("")
    L.append("## Steps as CUDA graphs against op by op (Janus, this card, this run)")
    L.append("")
    L.append("On: each step captured into a graph and launched as one, its host arrays in one "
             "upload (the default). Off: --gpu-graphs off, every op's kernels launched as the op "
             "is called. Ratio: step ms off over on (above 1: graphs faster).")
    L.append("")
    L.append("| batch | step ms on | step ms off | ratio | graph launches on | uploads on | "
             "uploads off | waits on | waits off |")
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    on_rows, off_rows = r["arserve"]["janus"]["speed"], r["arserve"]["janus"]["speed_graphs_off"]
    for b in BATCHES:
        on, off = on_rows.get(str(b), {}), off_rows.get(str(b), {})
        if not off:
            continue
        L.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            b, fmt(on.get("step_ms")), fmt(off.get("step_ms")),
            ratio(off.get("step_ms"), on.get("step_ms")),
            fmt(on.get("graph_launches_per_step"), "%.1f"),
            fmt(on.get("h2d_copies_per_step"), "%.1f"), fmt(off.get("h2d_copies_per_step"), "%.1f"),
            fmt(on.get("syncs_per_step"), "%.1f"), fmt(off.get("syncs_per_step"), "%.1f")))
    if not off_rows:
        L.append("| n/a | | | | | | | | |")
    L.append("")
    L.append("## The daemon on loopback (arserve bench, closed loop of C clients)")
    L.append("")
    L.append("| model | C | requests | images/s | in-process images/s at batch C | p50 ms | "
             "p90 ms | p99 ms | step ms (median) |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key in ("janus", "var"):
        name = r.get("models", {}).get(key, {}).get("name", key)
        for c in CONCURRENCY:
            d = r["arserve"][key]["daemon"].get(str(c))
            if not d:
                L.append("| %s | %d | n/a | | | | | | |" % (name, c))
                continue
            inproc = r["arserve"][key]["speed"].get(str(c), {}).get("images_per_s")
            L.append("| %s | %d | %d | %s | %s | %s | %s | %s | %s |" % (
                name, c, d["requests"], fmt(d["images_per_s"]), fmt(inproc),
                fmt(d.get("median_e2el_ms"), "%.0f"), fmt(d.get("p90_e2el_ms"), "%.0f"),
                fmt(d.get("p99_e2el_ms"), "%.0f"), fmt(d.get("median_step_ms"))))
    L.append("")
    L.append("## Stages")
    L.append("")
    L.append("| stage | status | seconds | note |")
    L.append("|---|---|---:|---|")
    for s in r["stages"]:
        L.append("| %s | %s | %.1f | %s |" % (s["name"], s["status"], s["seconds"],
                                              s.get("note", "").replace("|", "/")))
    L.append("| total | | %.1f | budget %.0f s |" % (r.get("total_s", 0), r["budget_s"]))
    L.append("")
    return "\n".join(L)


# ---- the workers (their own processes) --------------------------------------------------------

def worker_build(a):
    """Stage 1's torch process: the environment, the device's bandwidth, the Janus model."""
    t = time.perf_counter()
    import numpy
    import torch
    import transformers

    sys.path.insert(0, HERE)
    import ref_janus

    info = {"machine": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "numpy": numpy.__version__, "torch_cuda": torch.version.cuda}}
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_bench.py: no CUDA device for torch (torch.cuda.is_available() is False; "
                  "torch %s built for CUDA %s)" % (torch.__version__, torch.version.cuda),
                  file=sys.stderr)
            return 2
        p = torch.cuda.get_device_properties(0)
        info["machine"].update(torch_gpu=p.name, capability="%d.%d" % (p.major, p.minor),
                               sms=p.multi_processor_count, torch_gpu_memory_bytes=p.total_memory)
        info["bandwidth"] = device_bandwidth(torch)
    info["machine"]["torch_import_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    ref_janus.build(a.work, layers=None if a.small else 24, device=a.device,
                    shape="tiny" if a.small else "pro-1b")
    with open(os.path.join(a.work, "arserve.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(a.work, "reference.json")) as f:
        ref = json.load(f)
    info["janus"] = {"name": cfg["name"], "llm": cfg["llm"], "image": cfg["image"],
                     "decoder": cfg["decoder"], "sampling": cfg["sampling"],
                     "prompt": ref["prompt"], "build_s": round(time.perf_counter() - t, 2),
                     "weights_bytes": os.path.getsize(os.path.join(a.work, "model.safetensors"))}
    print(json.dumps(info), flush=True)
    return 0


def device_bandwidth(torch):
    """Read bandwidth of the device: the sum of a 2 GiB bf16 buffer, best of 5."""
    n = 1 << 30
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    x.sum()
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        x.sum(dtype=torch.float32)
        e.record()
        e.synchronize()
        best = max(best, 2 * n / (s.elapsed_time(e) / 1e3))
    del x
    torch.cuda.empty_cache()
    return {"device_read_bytes_per_s": best,
            "how": "torch: x.sum() over 2 GiB of bf16 on the device, best of 5 (CUDA events)"}


def worker_torch(a):
    """Stage 4's process: transformers' Janus at each batch, eager or with its decode step
    compiled; a JSON line per batch as it finishes (a timeout keeps the ones done)."""
    t = time.perf_counter()
    import torch

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))
    import gen_golden
    import ref_janus

    torch.set_num_threads(a.threads)
    with open(os.path.join(a.work, "reference.json")) as f:
        ref = json.load(f)
    lm, decode, cfg = ref_janus.load(a.work, ref, a.threads, a.device)
    cuda = a.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    sync()
    cond, uncond = gen_golden.prompt_ids(gen_golden.build_tokenizer())
    note = None
    if a.cond:  # arserve's rows, as speed_bench tokenised the same prompt
        ac, au = json.loads(a.cond), json.loads(a.uncond)
        if (ac, au) != (cond, uncond):
            note = "arserve's prompt rows %s differ from the golden tokenizer's %s; ran arserve's" \
                % (ac, cond)
            cond, uncond = ac, au
    s = cfg["sampling"]
    model = lm.model
    vision_cfg = model.model.vision_model.config
    n_tokens = vision_cfg.num_image_tokens
    # One cache length for every call (warm-ups included): transformers sizes its static cache
    # max(max_length, tokens + prompt), and a compiled step is specialised to it.
    extra = {"max_length": len(cond) + n_tokens}
    head = {"mode": a.mode, "load_s": round(time.perf_counter() - t, 2), "steps": n_tokens,
            "sampling": {k: s.get(k) for k in ("cfg", "temperature", "top_k", "top_p")},
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    if note:
        head["note"] = note
    if a.mode == "compiled":
        head.update(compile_decode_step(torch, model))
    print(json.dumps(head), flush=True)

    def generate(batch, times=None, tokens=None):
        gen = torch.Generator().manual_seed(batch)
        if tokens:
            vision_cfg.num_image_tokens = tokens
        try:
            return lm.generate(cond, uncond, batch, s["cfg"], s["temperature"], gen, times, **extra)
        finally:
            vision_cfg.num_image_tokens = n_tokens

    for batch in BATCHES:
        # Warm-up at this batch: 8 steps (the compiled variant compiles and records here) and
        # a decode of as many images.
        t = time.perf_counter()
        generate(batch, tokens=min(8, n_tokens))
        decode(torch.zeros((batch, n_tokens), dtype=torch.long, device=a.device))
        sync()
        warm = time.perf_counter() - t
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        t0 = time.perf_counter()
        toks = generate(batch, times)
        sync()
        t1 = time.perf_counter()
        decode(toks)
        sync()
        t2 = time.perf_counter()
        # times[k]: step k's generation head launched; from step 1's to the synchronised end:
        # the len - 2 steps after it, and the last one's sampling.
        steps = [y - x for x, y in zip(times[1:], times[2:])]
        row = {"batch": batch, "images_per_s": batch / (t2 - t0),
               "step_ms": 1e3 * (t1 - times[1]) / max(1, len(times) - 2),
               "step_ms_median_stamps": 1e3 * statistics.median(steps) if steps else None,
               "generate_s": t1 - t0, "decode_ms": 1e3 * (t2 - t1) / batch,
               "warmup_s": round(warm, 2), "tokens": list(toks.shape)}
        if cuda:
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        print(json.dumps(row), flush=True)
    if a.mode == "compiled":  # what the compiler did: graphs, breaks, CUDA graphs skipped
        from torch._dynamo.utils import counters

        breaks = counters.get("graph_break", {})
        print(json.dumps({"compile_stats": {
            "stats": dict(counters.get("stats", {})),
            "graph_breaks": sum(breaks.values()), "graph_break_reasons": list(breaks)[:5],
            "cudagraph_skips": counters.get("inductor", {}).get("cudagraph_skips", 0)}}),
            flush=True)
    return 0


def compile_decode_step(torch, model):
    """The language model's forward, compiled (mode reduce-overhead: CUDA graphs on a GPU) for
    the decode step (one new position per row); the prompt's forward stays eager. transformers
    5.23 hands the step a 4-D mask the static cache's length wide (compiles once); a version
    that hands a 2-D one (a column longer every step: a recompile each) gets it left out when
    it is all ones (no padding here: the unconditional row attends its pad tokens, as Janus's
    code does), which is the same as no mask over the static cache."""
    lm = model.model.language_model
    eager = lm.forward
    # dynamic=None: batch 1 compiles for its shapes, batch 8 once more with the batch
    # symbolic, batch 32 reuses that (CUDA graphs are recorded per shape either way).
    compiled = torch.compile(eager, mode="reduce-overhead")

    def forward(*args, **kw):
        emb = kw.get("inputs_embeds")
        if emb is not None and emb.shape[1] == 1:
            mask = kw.get("attention_mask")
            if mask is not None and mask.dim() == 2:
                if not bool(mask.all()):
                    raise RuntimeError("gpu_bench.py: a padded attention mask in the decode step")
                del kw["attention_mask"]
            return compiled(*args, **kw)
        return eager(*args, **kw)

    lm.forward = forward
    return {"compile": "torch.compile(language_model.forward, mode='reduce-overhead') for the "
                       "decode step; the prompt's forward eager"}


# ---- command line -----------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--bin", help="folder with arserve and speed_bench (KIT/bin, or build)")
    ap.add_argument("--out", help="folder for timing.json, timing.md and timing.log")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="seconds the whole run may take (default 240)")
    ap.add_argument("--small", action="store_true",
                    help="toy shapes: the same pipeline in seconds, on any device")
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                    help="arserve's backend, and where PyTorch runs (default cuda)")
    ap.add_argument("--threads", type=int,
                    help="CPU threads of arserve and of torch (default: cuda 0 = every core for "
                         "arserve and every core for torch; cpu 1)")
    ap.add_argument("--work", help="folder for the generated models (default: a temporary one, "
                                   "removed at the end)")
    ap.add_argument("--keep-models", action="store_true", help="keep --work's models")
    ap.add_argument("--torch-compile", choices=("auto", "on"), default="auto",
                    help="auto: compile the PyTorch step on a GPU only; on: on the CPU too")
    ap.add_argument("--stage", choices=("build", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--cond", help=argparse.SUPPRESS)
    ap.add_argument("--uncond", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.stage == "build":
        return worker_build(a)
    if a.stage == "torch":
        return worker_torch(a)
    if not a.bin or not a.out:
        ap.error("give --bin and --out")
    if a.budget_s <= 0:
        ap.error("--budget-s must be positive")
    if a.threads is None:
        a.threads = 0 if a.backend == "cuda" else 1
    a.out = os.path.abspath(a.out)  # the workers run in the repository's root
    os.makedirs(a.out, exist_ok=True)
    for name in ("timing.json", "timing.md", "timing.log"):
        if os.path.exists(os.path.join(a.out, name)):
            os.remove(os.path.join(a.out, name))
    a.work_is_temp = not a.work
    a.work = os.path.abspath(a.work) if a.work else tempfile.mkdtemp(prefix="gpu_bench.")
    b = Bench(a)
    try:
        b.run()
    except UsageError as e:
        b.r["error"] = str(e)
        b.save()
        print("gpu_bench.py: %s" % e, file=sys.stderr)
        if a.work_is_temp:
            shutil.rmtree(a.work, ignore_errors=True)
        return 2
    return 1 if b.failed else 0


if __name__ == "__main__":
    sys.exit(main())
