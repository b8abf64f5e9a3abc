"""The shapes dataset is a function of its seed: the same seed gives the same bytes in any
process, whatever Python's string hash seed (PYTHONHASHSEED) is there."""
import hashlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Digest of a shard's records and images, printed by a fresh interpreter.
DIGEST = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
from tools.shapes import dataset
records, images = dataset.generate(7, 0, 400)
h = hashlib.sha256(json.dumps(records, sort_keys=True).encode())
h.update(images.tobytes())
print(h.hexdigest(), sum(r["category"] == "three_objects" for r in records))
"""


def digest(hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
    out = subprocess.run([sys.executable, "-c", DIGEST, ROOT], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


def test_same_seed_same_bytes_across_hash_seeds():
    runs = [digest(s) for s in (1, 2, 3)]
    assert runs[0][1] > 10, "the sample must hold three-object scenes (the order-sensitive case)"
    assert len({d for d, _ in runs}) == 1, runs
    assert hashlib.sha256(b"").hexdigest() not in {d for d, _ in runs}


def test_resume_keeps_whole_shards_and_remakes_missing_ones(tmp_path):
    """dataset.py --resume (the training pipeline's data stage): shards already written are
    kept as they are, a missing one is drawn again to the same bytes, a leftover temporary
    file is not read as a shard, and a directory made with other arguments is refused."""
    sys.path.insert(0, ROOT)
    from tools.shapes import dataset

    out = str(tmp_path / "d")
    args = ["--out", out, "--n", "5", "--seed", "3", "--shard-size", "2"]
    assert dataset.main(args) == 0
    _, first = dataset.load_shards(out)
    kept = os.path.join(out, "shard-00000.npz")
    stamp = os.stat(kept).st_mtime_ns
    os.remove(os.path.join(out, "shard-00001.npz"))
    open(os.path.join(out, "shard-00002.tmp.npz"), "wb").close()  # what a kill leaves
    assert dataset.main(args + ["--resume"]) == 0
    assert os.stat(kept).st_mtime_ns == stamp, "a whole shard was written again"
    _, again = dataset.load_shards(out)
    assert again.shape == (5, 128, 128, 3) and (again == first).all()
    try:
        dataset.main(["--out", out, "--n", "5", "--seed", "4", "--shard-size", "2", "--resume"])
    except SystemExit as e:
        assert "made with" in str(e.code), e.code
    else:
        raise AssertionError("--resume into a dataset of another seed was not refused")
