"""tools/convert/janus.py refuses, from config.json alone and before any weight is read,
what the engine would refuse at load: grouped-query attention (in the engine's own
words, checked against build/arserve reading the same architecture), and a
vision_config.num_image_tokens that is not the grid's. No torch needed: the refusals
come before the checkpoint is opened.

    ARSERVE_BIN=build/arserve python -m pytest tests/python/test_convert_janus.py -q
"""

import json
import os
import subprocess
import sys

from conftest import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERTER = os.path.join(ROOT, "tools", "convert", "janus.py")
ARSERVE = os.environ.get("ARSERVE_BIN", os.path.join(ROOT, "build", "arserve"))


def tiny_config(**text):
    """A transformers-layout Janus config.json, as tests/golden/gen_golden.py writes its tiny one."""
    text_config = {"head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
                   "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "vocab_size": 64, **text}
    return {"model_type": "janus", "text_config": text_config,
            "vision_config": {"image_size": 32, "patch_size": 4, "num_image_tokens": 64},
            "vq_config": {"base_channels": 32, "channel_multiplier": [1, 1, 2], "embed_dim": 8,
                          "image_token_embed_dim": 64, "latent_channels": 32,
                          "num_embeddings": 64, "num_hidden_layers": 2, "num_res_blocks": 1,
                          "projection_dim": 64}}


def convert(tmp_path, config):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    p = subprocess.run([sys.executable, CONVERTER, str(src), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=scaled(60))
    return p.returncode, p.stderr


def test_grouped_query_config_is_refused_with_the_engines_message(tmp_path):
    rc, err = convert(tmp_path, tiny_config(num_key_value_heads=2))
    assert rc == 1, err
    assert "grouped-query attention is not supported" in err, err
    assert not (tmp_path / "out").exists(), "nothing is written for a refused checkpoint"

    # The engine reading the same architecture says the same sentence.
    with open(os.path.join(ROOT, "tests", "golden", "janus_tiny", "arserve.json")) as f:
        manifest = json.load(f)
    manifest["llm"]["num_kv_heads"] = 2
    model = tmp_path / "model"
    model.mkdir()
    (model / "arserve.json").write_text(json.dumps(manifest))
    p = subprocess.run([ARSERVE, "plan", "--model", str(model)], capture_output=True, text=True,
                       timeout=scaled(60))
    assert p.returncode != 0
    engine_says = "'llm.num_kv_heads' (2) differs from 'llm.num_heads' (4): " \
                  "grouped-query attention is not supported yet"
    assert engine_says in p.stderr, p.stderr
    assert engine_says in err, err


def test_num_image_tokens_must_be_the_grid(tmp_path):
    config = tiny_config()
    config["vision_config"]["num_image_tokens"] = 576
    rc, err = convert(tmp_path, config)
    assert rc == 1, err
    assert "num_image_tokens (576)" in err and "8 x 8 = 64" in err, err


def test_a_consistent_config_passes_the_architecture_checks(tmp_path):
    # Past the config checks the converter looks for the tokenizer: the
    # architecture itself was accepted.
    rc, err = convert(tmp_path, tiny_config())
    assert rc == 1 and "no tokenizer.json" in err, err
