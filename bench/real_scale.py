"""Real sizes end to end (make bench-real): each released model's files written at their real
shapes and layout (tools/release_shapes, random weights), converted by tools/convert in bounded
memory, served by `arserve serve` at their default sizes with the full cache and with a
compressed policy, and the measurements written to docs/real-scale.md.

Per model: files (GB) and the time to write them; conversion seconds and peak RSS against the
converters' stated bound; load seconds and RSS; then per request (size x policy): planned and
measured KV peak (they must be equal), the daemon's peak RSS against weights + planned pool +
overhead, seconds per image and per step; a request the pool cannot hold is shown with the
message a user gets.

Every stage's result is kept in WORK/results.json as it finishes, and a rerun skips what is
there (--again MODEL redoes one model), so a run of hours survives being stopped:

    .venv/bin/python bench/real_scale.py run var-d30 llamagen-xl --threads 1
    .venv/bin/python bench/real_scale.py table            # docs/real-scale.md from results.json
    .venv/bin/python bench/real_scale.py run --tiny ALL --work build/real-tiny --doc -   # smoke

`--tiny` runs the same pipeline on tools/release_shapes' tiny configurations (seconds).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools", "convert"))
import ckpt  # noqa: E402  (the converters' CHUNK_BYTES and peak RSS measurement)
from serving_sweep import free_port, wait_ready  # noqa: E402

GB = 1e9
MIB = 1 << 20
# The converters' stated peak: the interpreter with numpy (about 40 MB here), the checkpoint's
# pickle and index, and a chunk of source and of output (ckpt.CHUNK_BYTES each), with room.
CONVERT_BOUND = 192 * MIB + 4 * ckpt.CHUNK_BYTES
# The daemon's RSS beyond its weights and its KV pool: code, activations of one image, the
# image decoder's feature maps, PNG encoding. Stated per model below where it is larger.
SERVE_OVERHEAD = 1536 * MIB

INFINITY_SIZES = ("1024x1024", "1152x864", "720x1440")  # 1:1, 3:4 and 2:1 at 1M pixels


def _infinity(release, vae, sizes, pool_mb):
    return {
        "files": [release, vae, "flan-t5-xl"],
        "convert": ["infinity.py", "{rel}/" + release, "{rel}/" + vae, "{rel}/flan-t5-xl",
                    "{out}", "--pn", "1M", "--dtype", "bf16"],
        "tiny_convert_extra": ["--pn", "0.06M"],
        "request": {"prompt": "a red circle on the left of a blue square"},
        "cases": [(s, p) for s in sizes for p in (("full", None), ("heatkv", 0.1),
                                                   ("scalekv", 0.1))],
        "calibrate": True, "pool_mb": pool_mb, "default_size": sizes[0],
    }


# "tiny_cases": how many of the cases --tiny runs: Janus's VQ-16 decoder is full size even in
# the tiny release (4 s an image here), so the 1B's tiny run draws the full cache only and the
# 7B's, the same tiny model in the sharded layout, is converted and not served; the raster
# policies' smoke is LlamaGen's.
MODELS = {
    "janus-pro-1b": {
        "convert": ["janus.py", "{rel}", "{out}", "--dtype", "keep"],
        "request": {"prompt": "a red circle on the left of a blue square"},
        "cases": [(None, ("full", None)), (None, ("linear", 1 / 6)), (None, ("headkv", 0.125))],
        "pool_mb": 2048, "tiny_cases": 1,
    },
    "janus-pro-7b": {
        "convert": ["janus.py", "{rel}", "{out}", "--dtype", "keep"],
        "request": {"prompt": "a red circle on the left of a blue square"},
        "cases": [(None, ("full", None)), (None, ("linear", 1 / 6)), (None, ("headkv", 0.125))],
        "pool_mb": 2048, "tiny_cases": 0,
    },
    "llamagen-xl": {
        "convert": ["llamagen.py", "{rel}/c2i_XL_384.pt", "{rel}/vq_ds16_c2i.pt", "{out}",
                    "--dtype", "bf16"],
        "tiny_convert_extra": ["--n-head", "4"],  # a width outside LlamaGen's table of sizes
        "request": {"class_label": 207},
        "cases": [(None, ("full", None)), (None, ("linear", 1 / 6)), (None, ("headkv", 0.125))],
        "pool_mb": 1024,
    },
    "var-d30": {
        "convert": ["var.py", "{rel}/var_d30.pth", "{rel}/vae_ch160v4096z32.pth", "{out}",
                    "--dtype", "bf16"],
        "request": {"class_label": 207},
        "cases": [(None, ("full", None)), (None, ("heatkv", 0.1)), (None, ("scalekv", 0.1))],
        "calibrate": True, "pool_mb": 2048,
    },
    "infinity-2b": _infinity("infinity_2b_reg.pth", "infinity_vae_d32reg.pth", INFINITY_SIZES,
                             8192),
    # the full cache of one 1024 px image needs 7.4 GB (`arserve plan`): a 2 GiB pool holds only
    # the compressed ones, and refuses the full cache with the message shown in the table. Not
    # calibrated: a calibration draws with the full cache (in fp32, about 14.7 GB beside 19.6 GB
    # of weights), more than a 24 GiB machine holds, so at full size HeatKV and ScaleKV are
    # refused for the want of one, with the message a user sees (the tiny run calibrates;
    # "calibrate": True where the memory allows)
    "infinity-8b": {**_infinity("infinity_8b_weights", "infinity_vae_d56_f8_14_patchify.pth",
                                INFINITY_SIZES[:1], 2048), "calibrate": "tiny"},
    # The same release converted with 8-bit matrices (9.9 GB of weights, docs/weights-8bit.md),
    # so that the 8B draws on a 24 GiB machine. K and V in bf16, in the calibration (`arserve
    # calibrate --kv-dtype bf16`) and the daemon (`serve --kv-dtype bf16`; the default follows the
    # release's f32): the full cache's 7.07 GiB beside 9.25 GiB of weights, where f32's 14.1 GiB
    # would not fit. The pool holds the full cache too. Cases: the compressed ones first
    # (the default policy is what a user of this machine would run). Overhead: the activations of
    # a 1024 px image (the last scale's rows, both CFG rows, through 3,584-wide blocks) and the
    # d56 decoder's feature maps at 1024 px: the first full-cache draw of this model (2026-12-06,
    # docs/real-scale.md) peaked at 22.71 GB, 5.4 GB above its 9.93 GB of weights and 7.41 GB of
    # KV; the bound is 6 GiB (1.5 GiB, the other models', holds no 1024 px next-scale image:
    # Infinity-2B's HeatKV row is 4.9 GB above its weights and KV, inside its 8 GiB pool's room).
    "infinity-8b-int8": {
        **_infinity("infinity_8b_weights", "infinity_vae_d56_f8_14_patchify.pth",
                    INFINITY_SIZES[:1], 7168),
        "release": "infinity-8b", "kv_dtype": "bf16", "serve_overhead": 6 << 30,
        "cases": [(INFINITY_SIZES[0], p) for p in (("heatkv", 0.1), ("scalekv", 0.1),
                                                   ("full", None))],
    },
}
MODELS["infinity-8b-int8"]["convert"] = [x if x != "bf16" else "int8"
                                         for x in MODELS["infinity-8b-int8"]["convert"]]


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------

def measured_python(argv, log):
    """(seconds, peak RSS bytes) of `python3 argv...`; its output goes to log."""
    t0 = time.monotonic()
    p, peak = ckpt.run_measured(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if p.returncode:
        sys.exit(f"real_scale: {' '.join(argv)} failed (exit {p.returncode}); see {log.name}")
    return time.monotonic() - t0, peak


def du(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def proc_status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def post(url, body, timeout):
    req = urllib.request.Request(url + "/v1/images/generations", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.load(e), time.monotonic() - t0


# --------------------------------------------------------------------------------------------
# the pipeline
# --------------------------------------------------------------------------------------------

class Results:
    def __init__(self, path):
        self.path = path
        self.data = json.load(open(path)) if os.path.exists(path) else {}

    def get(self, model, stage):
        return self.data.get(model, {}).get(stage)

    def put(self, model, stage, value):
        self.data.setdefault(model, {})[stage] = value
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def run_model(name, a, res: Results, log):
    """Each stage of a model not yet in res: convert (its release written first), calibrate,
    serve."""
    work = os.path.join(a.work, name)
    os.makedirs(work, exist_ok=True)
    say = lambda msg: print(f"real_scale: {name}: {msg}", flush=True)  # noqa: E731
    if not res.get(name, "convert"):
        res.put(name, "convert", convert_stage(name, a, work, log, say))
    todo = [c for c in cases(name, a.tiny) if not res.get(name, case_key(c))]
    for size in calibrated_sizes(name, todo, a.tiny):
        key = "calibrate" + (f"/{size}" if size else "")
        if not res.get(name, key):
            res.put(name, key, calibrate_stage(name, a, work, log, say, size))
    if todo:
        serve_stage(name, a, work, todo, res, log, say)


def convert_stage(name, a, work, log, say):
    """The release written and converted: files, seconds, the converter's peak RSS."""
    m = MODELS[name]
    rel, out = os.path.join(work, "release"), os.path.join(work, "model")
    if os.path.exists(rel):
        shutil.rmtree(rel)
    argv = ["-m", "tools.release_shapes", m.get("release", name), rel, "--seed", "0"] + \
        (["--tiny"] if a.tiny else [])
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if p.returncode:
        sys.exit(f"real_scale: tools.release_shapes {name} failed; see {log.name}")
    files = {"seconds": time.monotonic() - t0, "bytes": du(rel)}
    say(f"release files {files['bytes'] / GB:.2f} GB in {files['seconds']:.0f} s")
    if os.path.exists(out):
        shutil.rmtree(out)
    conv = [os.path.join("tools", "convert", m["convert"][0])] + \
        [x.format(rel=rel, out=out) for x in m["convert"][1:]] + \
        (m.get("tiny_convert_extra", []) if a.tiny else [])
    secs, peak = measured_python(conv, log)
    row = {"files": files, "seconds": secs, "peak_rss": peak, "bound": CONVERT_BOUND,
           "command": "python3 " + " ".join(os.path.relpath(x, ROOT) if x.startswith(ROOT)
                                            else x for x in conv),
           "model_bytes": du(os.path.join(out, "model.safetensors"))}
    say(f"converted in {secs:.0f} s, peak RSS {peak / MIB:.0f} MiB (bound "
        f"{CONVERT_BOUND / MIB:.0f} MiB), model {row['model_bytes'] / GB:.2f} GB")
    if not a.keep_release:
        shutil.rmtree(rel)
    return row


def calibrated_sizes(name, todo, tiny):
    """The sizes the HeatKV and ScaleKV cases of todo draw, each calibrated by its own run (None:
    the default size, which `arserve calibrate` makes without --size); none for a model that is
    not calibrated (at full size, where "calibrate" is "tiny")."""
    want = MODELS[name].get("calibrate")
    if not want or (want == "tiny" and not tiny):
        return []
    sizes = [size for size, (policy, _) in todo if policy in ("heatkv", "scalekv")]
    default = MODELS[name].get("default_size")
    return list(dict.fromkeys(None if size == default else size for size in sizes))


def calibrate_stage(name, a, work, log, say, size=None):
    """`arserve calibrate` on the request's own prompt (HeatKV and ScaleKV need it), at size
    (None: the model's default); each size's run adds its calibration to the model's file."""
    prompts = os.path.join(work, "calibration_prompts.txt")
    with open(prompts, "w") as f:
        r = MODELS[name]["request"]
        f.write(f"{r.get('prompt', r.get('class_label'))}\n")
    cmd = [a.arserve, "calibrate", "--model", os.path.join(work, "model"), "--prompts", prompts,
           "--threads", str(a.threads)] + (["--size", size] if size else []) + \
        (["--kv-dtype", MODELS[name]["kv_dtype"]] if "kv_dtype" in MODELS[name] else [])
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if p.returncode:
        sys.exit(f"real_scale: {' '.join(cmd)} failed; see {log.name}")
    say(f"calibrated{' at ' + size if size else ''} in {time.monotonic() - t0:.0f} s")
    return {"seconds": time.monotonic() - t0, "prompts": 1}


def serve_stage(name, a, work, todo, res: Results, log, say):
    """The daemon on the converted model: its load, then each request of todo, each kept in
    res as it comes back."""
    m, out = MODELS[name], os.path.join(work, "model")
    pool_mb = m["pool_mb"] if not a.tiny else 64
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [a.arserve, "serve", "--model", out, "--port", str(port), "--kv-pool-mb", str(pool_mb),
           "--threads", str(a.threads), "--request-timeout-s", "86400", "--max-running", "1"] + \
        (["--kv-dtype", m["kv_dtype"]] if "kv_dtype" in m else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, timeout=3600)
        load = {"seconds": time.monotonic() - t0, "rss": proc_status(proc.pid, "VmRSS"),
                "pool_mb": pool_mb, "command": " ".join(os.path.relpath(x, ROOT)
                                                        if x.startswith(ROOT) else x for x in cmd)}
        res.put(name, "load", load)
        say(f"serving after {load['seconds']:.0f} s, RSS {load['rss'] / GB:.2f} GB")
        for case in todo:
            size, (policy, budget) = case
            body = {**m["request"], "seed": 0, "kv_policy": policy, "response_format": "b64_json"}
            if budget is not None:
                body["kv_budget"] = budget
            if size:
                body["size"] = size
            status, reply, secs = post(url, body, 86400)
            row = {"status": status, "seconds": secs, "hwm": proc_status(proc.pid, "VmHWM")}
            if status == 200:
                kv = reply.get("kv_cache", {})
                tm = reply.get("timings", {})
                row.update(planned=kv.get("planned_peak_bytes"), measured=kv.get("peak_bytes"),
                           steps=tm.get("steps"), run_s=tm.get("run_s"),
                           decode_s=tm.get("decode_png_s"))
                png = base64.b64decode(reply["data"][0]["b64_json"])
                with open(os.path.join(work, case_key(case).replace("/", "-") + ".png"), "wb") as f:
                    f.write(png)
            else:
                row["message"] = reply.get("error", {}).get("message")
            res.put(name, case_key(case), row)
            say(f"{case_key(case)}: {status} in {secs:.1f} s"
                + (f", KV planned {row.get('planned')} measured {row.get('measured')}"
                   if status == 200 else f": {row.get('message')}"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def cases(name, tiny):
    """The requests a model gets: (size or None for the default, (policy, budget)); a tiny
    configuration has other sizes, so it draws its default size only."""
    out = MODELS[name]["cases"]
    if tiny:
        out = [(None, p) for p in dict.fromkeys(p for _, p in out)]
        out = out[:MODELS[name].get("tiny_cases", len(out))]
    return out


def case_key(case):
    size, (policy, budget) = case
    return "/".join(x for x in (size, policy, f"{budget:g}" if budget is not None else None) if x)


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------

def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def preset_differences(model_dir, name):
    """Keys of the converted arserve.json whose values differ from config/presets/NAME's (the
    architecture `arserve plan` assumes for the model), past the file names it lists."""
    try:
        got = _flat(json.load(open(os.path.join(model_dir, "arserve.json"))))
        want = _flat(json.load(open(os.path.join(ROOT, "config", "presets", name, "arserve.json"))))
    except OSError:
        return None
    skip = ("name", "weights", "tokenizer", "condition.class_names")
    return sorted(k for k in set(got) | set(want)
                  if not k.startswith(skip) and got.get(k) != want.get(k))


def doc_rows(path):
    """{model: (its table rows, its command line)} from the table of the doc at path: the rows of
    the models a run has no results for are kept as they stand (results.json lives in the build
    folder, the doc in the repository)."""
    kept = {}
    try:
        text = open(path).read()
    except OSError:
        return kept
    begin, end = "<!-- real-scale table -->", "<!-- end of table -->"
    if begin not in text or end not in text:
        return kept
    name = None
    for line in text[text.index(begin):text.index(end)].splitlines()[3:]:
        if line.startswith("| "):
            first = line.split("|")[1].strip()
            name = first or name
            if name in MODELS:
                kept.setdefault(name, ([], None))[0].append(line)
        elif line.startswith("- ") and ": `" in line and line[2:].split(":", 1)[0] in kept:
            who = line[2:].split(":", 1)[0]
            kept[who] = (kept[who][0], line)
    return kept


def table(res: Results, tiny: bool, work: str, kept=None) -> tuple[str, list[str]]:
    """(markdown, problems): a row per model and case (a model without results: its rows of kept,
    doc_rows', if any); a plan that differs from what was measured, a peak over its bound, or (at
    full size) a converted architecture that is not its preset's, is a problem."""
    kept = kept or {}
    problems = []
    out = ["| model | files GB | convert s | convert peak RSS (bound) | model GB | load s | "
           "load RSS GB | request | KV planned MiB | KV measured MiB | daemon peak RSS GB "
           "(weights + pool + overhead) | s / image | s / step (steps) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in MODELS:
        d = res.data.get(name)
        if not d or "convert" not in d:
            out += kept[name][0] if name in kept else [f"| {name} | not run yet | | | | | | | | | | | |"]
            continue
        c, ld = d["convert"], d.get("load", {})
        diff = None if tiny else preset_differences(os.path.join(work, name, "model"),
                                                    MODELS[name].get("release", name))
        if diff:
            problems.append(f"{name}: the converted arserve.json differs from "
                            f"config/presets/{name} in {', '.join(diff)}")
        if c["peak_rss"] > c["bound"]:
            problems.append(f"{name}: conversion peak {c['peak_rss']} over its bound {c['bound']}")
        head = (f"| {name} | {c['files']['bytes'] / GB:.2f} | {c['seconds']:.0f} | "
                f"{c['peak_rss'] / MIB:.0f} MiB ({c['bound'] / MIB:.0f}) | "
                f"{c['model_bytes'] / GB:.2f} | "
                + (f"{ld['seconds']:.0f} | {ld['rss'] / GB:.2f} |" if ld else " | |"))
        keys = [case_key(k) for k in cases(name, tiny)]
        if not any(k in d for k in keys):
            out.append(head + " not served yet | | | | | |")
        for k in keys:
            r = d.get(k)
            if r is None:
                continue
            if r["status"] != 200:
                out.append(f"{head} {k}: refused ({r['status']}): \"{r['message']}\" | | | | | |")
            else:
                cap = (c["model_bytes"] + ld.get("pool_mb", 0) * MIB
                       + MODELS[name].get("serve_overhead", SERVE_OVERHEAD))
                if r["planned"] != r["measured"]:
                    problems.append(f"{name} {k}: KV planned {r['planned']} != measured {r['measured']}")
                if r["hwm"] > cap:
                    problems.append(f"{name} {k}: daemon peak RSS {r['hwm']} over {cap}")
                step = r["run_s"] / r["steps"] if r.get("steps") else float("nan")
                out.append(f"{head} {k} | {r['planned'] / MIB:.1f} | {r['measured'] / MIB:.1f} | "
                           f"{r['hwm'] / GB:.2f} ({cap / GB:.2f}) | {r['seconds']:.1f} | {step:.3f} "
                           f"({r.get('steps')}) |")
            head = "| | | | | | | |"
    cmds = [f"- {name}: `{d['convert']['command']}`"
            + (f"; `{d['load']['command']}`" if d.get("load") else "")
            if d and "convert" in d else kept[name][1]
            for name, d in ((n, res.data.get(n)) for n in MODELS)
            if (d and "convert" in d) or (name in kept and kept[name][1])]
    if cmds:
        out += ["", "Commands (each model's release from `python3 -m tools.release_shapes MODEL "
                "DIR --seed 0`):", ""] + cmds
    return "\n".join(out) + "\n", problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("models", nargs="+", help=f"{', '.join(MODELS)}, or ALL")
    r.add_argument("--tiny", action="store_true", help="tools/release_shapes' tiny configurations")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--again", action="append", default=[], help="redo this model's stages")
    r.add_argument("--keep-release", action="store_true", help="keep the written release files")
    t = sub.add_parser("table")
    for p in (r, t):
        p.add_argument("--work", default=os.path.join(ROOT, "build", "real"))
        p.add_argument("--arserve", default=os.path.join(ROOT, "build", "arserve"))
        p.add_argument("--doc", default=os.path.join(ROOT, "docs", "real-scale.md"),
                       help="where the table goes (- for stdout)")
    a = ap.parse_args(argv)
    a.tiny = getattr(a, "tiny", False)
    os.makedirs(a.work, exist_ok=True)
    res = Results(os.path.join(a.work, "results.json"))
    if a.cmd == "run":
        names = list(MODELS) if a.models == ["ALL"] else a.models
        bad = [n for n in names if n not in MODELS]
        if bad:
            ap.error(f"unknown model {', '.join(bad)}; one of {', '.join(MODELS)} or ALL")
        for n in a.again:
            res.data.pop(n, None)
        with open(os.path.join(a.work, "log.txt"), "a") as log:
            for n in names:
                run_model(n, a, res, log)
    md, problems = table(res, a.tiny, a.work, None if a.doc == "-" else doc_rows(a.doc))
    if a.doc == "-":
        sys.stdout.write(md)
    else:
        write_doc(a.doc, md)
    for p in problems:
        print(f"real_scale: {p}", file=sys.stderr)
    return 1 if problems else 0


def write_doc(path, md):
    """Replaces the table between the markers of docs/real-scale.md, keeping the prose."""
    begin, end = "<!-- real-scale table -->", "<!-- end of table -->"
    text = open(path).read() if os.path.exists(path) else f"# Real sizes\n\n{begin}\n{end}\n"
    a, b = text.index(begin) + len(begin), text.index(end)
    with open(path, "w") as f:
        f.write(text[:a] + "\n" + md + text[b:])


if __name__ == "__main__":
    sys.exit(main())
