#!/usr/bin/env python3
"""`make bench`: arserve against PyTorch on the same model, side by side in one run.

    python bench/speed_bench.py --bin build/speed_bench --arserve build/arserve \\
        --model models/shapes --model build/mid-model [--threads 1,2] [--batch 8] ...

For every model and thread count, --rounds times in turn: build/speed_bench (the engine
in-process, bench/speed_bench.c) and the same workload in torch (this script with
--torch-worker: tools/train/raster/lm_model.py's JanusLM.generate, a KV cache, CFG, the model's
sampling (temperature, top-k and top-p in engine/sampler.c's order), then the VQ decoder of
tools/train/raster/vq_model.py, all on the model directory's weights as fp32). Each process runs
waves of 1 and of --batch images of one prompt, alternating --reps times, and reports
median images/s, the median decode step (a step after the prompt's) and the VQ decode per
image; this script reads each process's peak RSS from the kernel (wait4). The table prints
the medians over rounds and each ratio arserve / torch, the engine's decode step as a share
of the memory roofline (the bytes of weights a step reads over the read bandwidth
speed_bench measured on the same threads) and of the compute roofline (their multiply-adds
for the step's rows at the FMA peak it measured), and with --arserve the daemon on loopback
at concurrency 1/4/16/... (`arserve bench --arrival concurrency`) beside the engine
in-process at the same batch. Each table row names the instruction set arserve's kernels ran
and the read bandwidth and FMA peak measured with it: --isa avx2,avx512 measures both in one
run, each side held to the set by its environment (ARSERVE_ISA; ATEN_CPU_CAPABILITY, oneDNN's
and MKL's limits for torch), so an AVX-512 machine also stands in for an AVX2-only one.

A model directory with a reference.json has its own PyTorch reference instead of JanusLM:
bench/ref_janus.py (transformers' Janus) or bench/ref_llamagen.py (LlamaGen's official
classes, from the checkout $LLAMAGEN_SRC names), which also build those directories; the
daemon is not timed on them.

Needs torch (tools/requirements.txt; `make bench` uses .venv-tools, or with BENCH_TORCH=cpu
.venv-bench: torch without its CUDA wheels, bench/requirements-torch-cpu.txt).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---- the torch side ----------------------------------------------------------------------

def torch_models(model_dir):
    """(JanusLM, VQ decode function, arserve.json) from a model directory's files."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "tools", "train", "raster"))
    sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
    from lm_model import JanusLM
    from train_util import load_weights
    from vq_model import Decoder

    with open(os.path.join(model_dir, "arserve.json")) as f:
        cfg = json.load(f)
    tensors = {}  # in float32, an 8-bit weight times its scales: the values arserve computes with
    for name in cfg["weights"]:
        tensors.update(load_weights(os.path.join(model_dir, name)))

    lm = JanusLM(cfg["llm"], cfg["image"]).eval()
    lm.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("vq.")})

    dec_cfg, im = cfg["decoder"], cfg["image"]
    vq = nn.Module()
    vq.codebook = nn.Embedding(im["codebook_size"], im["embed_dim"])
    vq.post_quant_conv = nn.Conv2d(im["embed_dim"], dec_cfg["latent_channels"], 1)
    vq.decoder = Decoder(dec_cfg)
    vq.load_state_dict({k[len("vq."):]: v for k, v in tensors.items() if k.startswith("vq.")})
    vq.eval()

    @torch.no_grad()
    def decode(tokens):
        """[B, N] tokens -> [B, H, W, 3] uint8, as the engine decodes."""
        grid = tokens.view(-1, im["grid_height"], im["grid_width"])
        z = F.normalize(vq.codebook.weight, dim=1)[grid].permute(0, 3, 1, 2)
        x = vq.decoder(vq.post_quant_conv(z))
        return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)

    return lm, decode, cfg


def reference(model_dir):
    """A model directory's reference.json (which PyTorch implementation is its torch side),
    or None: tools/train's JanusLM then."""
    path = os.path.join(model_dir, "reference.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def reference_load(ref):
    """The `load(model_dir, ref, threads)` of the file that runs reference `ref`."""
    sys.path.insert(0, HERE)
    if ref["impl"] == "transformers-janus":
        import ref_janus
        return ref_janus.load
    if ref["impl"] == "llamagen":
        import ref_llamagen
        return ref_llamagen.load
    raise SystemExit("speed_bench.py: unknown reference implementation %r" % ref["impl"])


def reference_in_float32(choice):
    """Whether a reference implementation's torch side runs in float32 under --torch-dtype
    `choice` rather than in its own dtype (the one its loader picks: bf16 for transformers'
    Janus, reference.json's precision for LlamaGen): always for "float32", never for "model",
    and for "auto" where torch does not run AVX-512 kernels: there its bf16 matmuls and
    convolutions fall to slow paths (a Janus-Pro-shaped decoder took more than 150 s an image
    with torch limited to AVX2, 4.2 s in float32), so float32 is what a user of such a
    machine would run."""
    import torch

    return choice == "float32" or (choice == "auto"
                                   and torch.backends.cpu.get_cpu_capability() != "AVX512")


def torch_worker(a):
    import torch

    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    ref = reference(a.model)
    cond, uncond = json.loads(a.cond), json.loads(a.uncond)
    if ref:
        dtype = torch.float32 if reference_in_float32(a.torch_dtype) else None
        lm, decode, cfg = reference_load(ref)(a.model, ref, a.threads, dtype=dtype)
        dtype = str(lm.dtype).replace("torch.", "")
    else:
        lm, decode, cfg = torch_models(a.model)
        dtype = "float32"
    s = cfg["sampling"]
    # JanusLM samples with the model's top-k and top-p as the engine does (lm_model.py's
    # sample_next); the references read them from arserve.json themselves.
    extra = {} if ref else {"top_k": s.get("top_k", 0), "top_p": s.get("top_p", 1.0)}
    if not ref:
        self_check(lm, cond, uncond, s["cfg"])

    def waves(batch, images):
        steps, decodes = [], []
        t0 = time.perf_counter()
        for done in range(0, images, batch):
            gen = torch.Generator().manual_seed(done)
            times = []
            toks = lm.generate(cond, uncond, batch, s["cfg"], s["temperature"], gen, times, **extra)
            steps += [b - a for a, b in zip(times, times[1:])]  # the steps after the prompt's
            d0 = time.perf_counter()
            decode(toks)
            decodes.append((time.perf_counter() - d0) / batch)
        return time.perf_counter() - t0, statistics.median(steps), statistics.median(decodes)

    waves(1, 1)  # warm-up, as speed_bench.c
    took = {1: [], a.batch: []}
    for _ in range(a.reps):
        for b in (1, a.batch):
            took[b].append(waves(b, a.images))
    rows = []
    for b in (1, a.batch):
        set_s = statistics.median(t[0] for t in took[b])
        rows.append({"batch": b, "images_per_s": a.images / set_s,
                     "step_s": statistics.median(t[1] for t in took[b]),
                     "decode_s": statistics.median(t[2] for t in took[b])})
    used = {"cfg": s["cfg"], "temperature": s["temperature"], "top_k": s.get("top_k", 0),
            "top_p": s.get("top_p", 1.0)}
    print(json.dumps({"batches": rows, "sampling": used, "dtype": dtype}))


def self_check(lm, cond, uncond, cfg_w):
    """The cached decode's first greedy tokens are the uncached forward's: the torch side
    runs the model it claims to."""
    import torch

    n = 8
    toks = lm.generate(cond, uncond, 1, cfg_w, 0.0)[0, :n].tolist()
    ids = torch.tensor([cond, uncond])
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        logits = lm(ids, valid, torch.tensor([toks, toks]))
    mixed = logits[1] + cfg_w * (logits[0] - logits[1])
    ref = mixed.argmax(-1).tolist()
    if ref != toks:
        raise SystemExit("speed_bench.py: torch's cached decode %s differs from its forward %s"
                         % (toks, ref))


# ---- the driver --------------------------------------------------------------------------

# An instruction set asked for with --isa: each side's environment that holds it (and
# its libraries: OpenBLAS, oneDNN, MKL) to that set. avx2 on an AVX-512 machine is
# how this machine stands in for the AVX2-only ones (most AMD Zen 2/3, Intel client).
ISA_ENV = {
    "avx2": {"arserve": {"ARSERVE_ISA": "avx2", "OPENBLAS_CORETYPE": "Haswell"},
             "torch": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                       "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}},
    "avx512": {"arserve": {"ARSERVE_ISA": "avx512"}, "torch": {}},
}


def side_env(isa, side):
    """os.environ with what holds `side` (arserve or torch) to `isa` ("" = the machine's best)."""
    return dict(os.environ, **(ISA_ENV[isa][side] if isa else {}))


def run_rss(cmd, env=None):
    """(stdout, peak RSS in MiB) of a process that must succeed (wait4's rusage)."""
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read()
        if p.returncode != 0:
            raise SystemExit("speed_bench.py: %s exited %d: %s" % (" ".join(cmd), p.returncode,
                                                                  err.read()[-2000:]))
    return json.loads(text.strip().splitlines()[-1]), ru.ru_maxrss / 1024.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_sweep(a, model, threads, prompt, env):
    """{concurrency: images/s} of a daemon on loopback, `arserve bench` as the client."""
    port = free_port()
    log = tempfile.TemporaryFile()
    top = max(a.concurrency)
    d = subprocess.Popen([a.arserve, "serve", "--model", model, "--host", "127.0.0.1",
                          "--port", str(port), "--threads", str(threads),
                          "--max-running", str(top), "--max-waiting", str(4 * top),
                          "--kv-pool-mb", str(a.daemon_pool_mib)],
                         stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = "http://127.0.0.1:%d" % port
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if d.poll() is not None:
                    log.seek(0)
                    raise SystemExit("speed_bench.py: the daemon exited: %s" % log.read()[-2000:])
                time.sleep(0.1)
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            for c in a.concurrency:
                n = max(a.daemon_requests, c)
                subprocess.run([a.arserve, "bench", "--url", url, "--arrival", "concurrency",
                                "--concurrency", str(c), "-n", str(n), "--prompt", prompt,
                                "--no-progress", "--scrape-interval", "0", "-o", tmp,
                                "--label", "c%d" % c], check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(tmp, "c%d.json" % c)) as f:
                    r = json.load(f)
                out[c] = r["images_per_s"]
        return out
    finally:
        d.terminate()
        d.wait(30)


def fmt_ratio(x, y):
    return "%.2fx" % (x / y) if y else "n/a"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "speed_bench"))
    ap.add_argument("--arserve", help="also time the daemon at --concurrency (build/arserve)")
    ap.add_argument("--model", action="append", help="model directories (repeatable)")
    ap.add_argument("--prompt", default="a red circle on the left")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--images", type=int, default=8, help="images per wave set (a multiple of --batch)")
    ap.add_argument("--reps", type=int, default=1, help="wave sets per batch size in each process")
    ap.add_argument("--rounds", type=int, default=2, help="arserve/torch process pairs per row")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--daemon-requests", type=int, default=16)
    ap.add_argument("--daemon-pool-mib", type=int, default=2048)
    ap.add_argument("--isa", default="",
                    help="instruction sets, comma-separated (avx512, avx2: each side held to it "
                         "by its environment); default the machine's best")
    ap.add_argument("--torch-dtype", choices=("auto", "model", "float32"), default="auto",
                    help="the dtype of a reference implementation's torch side (reference.json's "
                         "models): its own (model), float32, or auto: its own where torch runs "
                         "AVX-512 kernels, float32 elsewhere (default auto)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cond", help=argparse.SUPPRESS)
    ap.add_argument("--uncond", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.torch_worker:
        a.threads = int(a.threads)
        a.model = a.model[0]
        return torch_worker(a)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    isas = a.isa.split(",") if a.isa else [""]
    for isa in isas:
        if isa and isa not in ISA_ENV:
            ap.error("--isa %s: not one of %s" % (isa, ", ".join(ISA_ENV)))
    models = a.model or [os.path.join(ROOT, "models", "shapes")]
    results = []
    for model, threads, isa in ((m, int(t), i) for m in models for t in a.threads.split(",")
                                for i in isas):
        ours_env, torch_env = side_env(isa, "arserve"), side_env(isa, "torch")
        ref = reference(model)
        prompt = ref.get("prompt", a.prompt) if ref else a.prompt
        common = ["--model", model, "--batch", str(a.batch), "--images", str(a.images),
                  "--reps", str(a.reps), "--threads", str(threads)]
        runs = {"arserve": [], "torch": []}
        roof, _ = run_rss([a.bin, "--json", "--measure", "roofline"] + common, ours_env)
        for r in range(a.rounds):
            ours, rss = run_rss([a.bin, "--prompt", prompt, "--json", "--measure", "speed"] + common,
                                ours_env)
            runs["arserve"].append((ours, rss))
            # A class-conditional model's rows: class 0 and the null class.
            cond = ours.get("cond", [0])
            uncond = ours.get("uncond", [ours.get("num_classes", 0)])
            theirs, trss = run_rss([sys.executable, os.path.abspath(__file__), "--torch-worker",
                                    "--torch-dtype", a.torch_dtype, "--cond", json.dumps(cond),
                                    "--uncond", json.dumps(uncond)] + common, torch_env)
            runs["torch"].append((theirs, trss))
            print("  %s, %d thread(s), %s, round %d: arserve %s, torch %s images/s" % (
                ours["model"], threads, roof["vector_isa"], r + 1,
                "/".join("%.2f" % b["images_per_s"] for b in ours["batches"]),
                "/".join("%.2f" % b["images_per_s"] for b in theirs["batches"])),
                file=sys.stderr, flush=True)
        row = {"model": runs["arserve"][0][0]["model"], "threads": threads, "batches": [],
               "reference": ref["impl"] if ref else "JanusLM (tools/train)",
               "torch_sampling": runs["torch"][0][0]["sampling"],
               "torch_dtype": runs["torch"][0][0]["dtype"],
               "kv_dtype": runs["arserve"][0][0]["kv_dtype"]}
        for i, b in enumerate((1, a.batch)):
            def med(side, key):
                return statistics.median(x[0]["batches"][i][key] for x in runs[side])
            row["batches"].append({
                "batch": b,
                "arserve": {k: med("arserve", k) for k in ("images_per_s", "step_s", "decode_s")},
                "torch": {k: med("torch", k) for k in ("images_per_s", "step_s", "decode_s")}})
        row["rss_mib"] = {side: max(x[1] for x in runs[side]) for side in runs}
        row["read_gb_per_s"] = roof["read_bytes_per_s"] / 1e9
        row["step_weight_mib"] = roof["step_weight_bytes"] / 2**20
        row["fma_gflops"] = roof["fma_flops_per_s"] / 1e9
        row["vector_isa"] = roof["vector_isa"]
        for b in row["batches"]:  # the step's least time over its measured time
            o = b["arserve"]
            o["roofline"] = roof["step_weight_bytes"] / roof["read_bytes_per_s"] / o["step_s"]
            # two rows an image (the CFG pair), a multiply-add per weight per row
            flops = 2 * 2 * b["batch"] * roof["step_weight_elems"]
            o["compute_roofline"] = (flops / roof["fma_flops_per_s"] / o["step_s"]
                                     if roof["fma_flops_per_s"] else 0)
        if a.arserve and not ref:  # the daemon sweep: text-prompted models of our own
            row["daemon"] = daemon_sweep(a, model, threads, prompt, ours_env)
        results.append(row)

    # Each row says which machine made it: the instruction set arserve's kernels ran and
    # the read bandwidth and FMA peak measured on its threads with that set.
    head = "%-12s %3s %-8s %5s  %9s %9s %6s  %8s %8s %6s  %7s %7s  %8s %8s  %6s %7s"
    print(head % ("model", "thr", "isa", "batch", "arserve", "torch", "ratio", "step ms", "torch",
                  "ratio", "VQ ms", "torch", "roofline", "roofline", "read", "FMA"))
    print(head % ("", "", "", "", "images/s", "images/s", "", "arserve", "", "", "arserve", "",
                  "memory", "compute", "GB/s", "GFLOP/s"))
    for row in results:
        for b in row["batches"]:
            o, t = b["arserve"], b["torch"]
            print("%-12s %3d %-8s %5d  %9.2f %9.2f %6s  %8.2f %8.2f %6s  %7.1f %7.1f  %7.0f%% %7.0f%%"
                  "  %6.1f %7.0f" % (
                      row["model"][:12], row["threads"], row["vector_isa"], b["batch"],
                      o["images_per_s"], t["images_per_s"],
                      fmt_ratio(o["images_per_s"], t["images_per_s"]), o["step_s"] * 1e3,
                      t["step_s"] * 1e3, fmt_ratio(t["step_s"], o["step_s"]), o["decode_s"] * 1e3,
                      t["decode_s"] * 1e3, 100 * o["roofline"], 100 * o["compute_roofline"],
                      row["read_gb_per_s"], row["fma_gflops"]))
    print()
    print("the torch side (and its dtype on each instruction set), the sampling both sides ran,"
          " and the KV cache arserve stored:")
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model]
        row = rows[0]
        dtypes = ", ".join(dict.fromkeys("%s on %s" % (r["torch_dtype"], r["vector_isa"])
                                         for r in rows))
        print("  %-12s %s (%s); cfg %g, temperature %g, top-k %d, top-p %g; arserve's KV %s" % (
            model[:12], row["reference"], dtypes, *(row["torch_sampling"][k] for k in
                                                    ("cfg", "temperature", "top_k", "top_p")),
            row["kv_dtype"]))
    print()
    print("peak RSS (MiB, the largest of the rounds), and the roofline's terms:")
    for row in results:
        print("  %-12s %d thread(s), %s: arserve %.0f, torch %.0f (%.2fx less); %.1f MiB of weights "
              "per step, %.1f GB/s read, %.0f GFLOP/s FMA peak" % (
                  row["model"][:12], row["threads"], row["vector_isa"], row["rss_mib"]["arserve"], row["rss_mib"]["torch"],
                  row["rss_mib"]["torch"] / row["rss_mib"]["arserve"], row["step_weight_mib"],
                  row["read_gb_per_s"], row["fma_gflops"]))
    if any("daemon" in r for r in results):
        print()
        print("the daemon on loopback (arserve bench, a closed loop of C clients), images/s, and "
              "the ratio to the engine in-process (batch 1 for C=1, else batch %d):" % a.batch)
        for row in (r for r in results if "daemon" in r):
            inproc = [b["arserve"]["images_per_s"] for b in row["batches"]]
            print("  %-12s %d thread(s), %s: %s" % (
                row["model"][:12], row["threads"], row["vector_isa"],
                ", ".join("C=%d %.2f (%.2fx)" % (c, v, v / inproc[c > 1]) for c, v in row["daemon"].items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
