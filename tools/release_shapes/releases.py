"""The file list of each release: which files, which tensors in which container, the config and
tokenizer JSONs, and how sharded releases split their tensors, at full size or --tiny (same
names, dtypes, formats, shard counts and config fields at a small width and depth)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import nets, tables, tokenizers_out

MODELS = ("janus-pro-1b", "janus-pro-7b", "llamagen-xl", "var-d30", "infinity-2b", "infinity-8b")
# Not releases: the mid sizes the next-scale speed bench (bench/scale_bench.py) times, laid out
# as infinity-2b's release (width 1024, depth 16, 16 heads; the 2B's d32 VAE; a tiny T5)
BENCH_MODELS = ("infinity-mid",)
VAR_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
HF_MAX_SHARD = 10 * 10 ** 9  # transformers' max_shard_size="10GB" of the time the releases were saved


@dataclass
class File:
    path: str
    kind: str  # "torch", "safetensors" or "text"
    tensors: list = field(default_factory=list)
    wrap: str | None = None  # torch.save({wrap: state_dict}) instead of the state dict itself
    text: str = ""
    metadata: dict | None = None


@dataclass
class Release:
    model: str
    tiny: bool
    files: list
    notes: list = field(default_factory=list)

    def tensors(self):
        return [t for f in self.files for t in f.tensors]

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors() if not t.buffer)

    @property
    def elements(self) -> int:
        return sum(t.numel for t in self.tensors())


def _json(obj, indent=2) -> str:
    return json.dumps(obj, indent=indent, ensure_ascii=False) + "\n"


def _index(files: list) -> str:
    wm = {t.name: f.path.rsplit("/", 1)[-1] for f in files for t in f.tensors}
    total = sum(t.nbytes for f in files for t in f.tensors)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))},
                      indent=2, sort_keys=False) + "\n"


def hf_shard_ends(sizes: list, max_bytes: int) -> list:
    """transformers' shard_checkpoint: fill a shard in state-dict order until the next tensor
    would pass max_bytes. Returns the index one past each shard's last tensor."""
    ends, cur = [], 0
    for i, s in enumerate(sizes):
        if cur and cur + s > max_bytes:
            ends.append(i)
            cur = 0
        cur += s
    return ends + [len(sizes)]


def split_by_fraction(tensors: list, fractions: list) -> list:
    """Splits tensors (in order) where the running byte total passes each fraction: how a --tiny
    release keeps the full release's shard count and roughly its split points."""
    total = sum(t.nbytes for t in tensors) or 1
    parts, cur, acc, k = [], [], 0, 0
    for t in tensors:
        if k < len(fractions) and cur and acc / total >= fractions[k]:
            parts.append(cur)
            cur, k = [], k + 1
        cur.append(t)
        acc += t.nbytes
    parts.append(cur)
    while len(parts) < len(fractions) + 1:  # never fewer shards than the release
        big = max(range(len(parts)), key=lambda i: len(parts[i]))
        half = len(parts[big]) // 2
        parts[big:big + 1] = [parts[big][:half], parts[big][half:]]
    return parts


def _fractions(full: list, ends: list) -> list:
    total = sum(t.nbytes for t in full)
    return [sum(t.nbytes for t in full[:e]) / total for e in ends[:-1]]


# ---- Janus-Pro --------------------------------------------------------------------------------

JANUS_FULL = {
    "janus-pro-1b": dict(layers=24, hidden=2048, ffn=5632, heads=16, vocab=102400, codes=16384, embed=8,
                         vision=(1024, 24, 384, 16)),
    "janus-pro-7b": dict(layers=30, hidden=4096, ffn=11008, heads=32, vocab=102400, codes=16384, embed=8,
                         vision=(1024, 24, 384, 16)),
}
# --tiny: a small LLM and vision tower; the VQ-16 stays full size because deepseek's code builds
# VQ_16() whatever the config says (and tools/convert/janus.py checks it against those sizes).
JANUS_TINY = dict(layers=2, hidden=64, ffn=128, heads=4, vocab=512, codes=16384, embed=8,
                  vision=(64, 2, 384, 16))  # the real 24 x 24 grid, so the KV policies' budgets apply
JANUS_TINY_BPE = 480


def janus_config(a: dict, explicit_sizes: bool) -> dict:
    """deepseek's config.json (model_type multi_modality). The 7B's language_config lists only
    what differs from LlamaConfig's defaults (4096 / 11008 / 32 heads); the 1B's names its sizes."""
    lang = {"max_position_embeddings": 16384, "model_type": "llama", "num_hidden_layers": a["layers"],
            "torch_dtype": "bfloat16", "vocab_size": a["vocab"]}
    if explicit_sizes:
        lang.update({"hidden_size": a["hidden"], "intermediate_size": a["ffn"],
                     "num_attention_heads": a["heads"], "num_key_value_heads": a["heads"]})
    H, vw = a["hidden"], a["vision"][0]
    return {
        "aligner_config": {"cls": "MlpProjector", "model_type": "aligner",
                           "params": {"depth": 2, "input_dim": vw, "n_embed": H, "projector_type": "mlp_gelu"}},
        "gen_aligner_config": {"cls": "MlpProjector", "model_type": "gen_aligner",
                               "params": {"depth": 2, "input_dim": a["embed"], "n_embed": H,
                                          "projector_type": "mlp_gelu"}},
        "gen_head_config": {"cls": "vision_head", "model_type": "gen_head",
                            "params": {"image_token_embed": H, "image_token_size": a["codes"], "n_embed": H}},
        "gen_vision_config": {"cls": "VQ-16", "model_type": "gen_vision",
                              "params": {"image_token_size": a["codes"], "n_embed": a["embed"]}},
        "language_config": dict(sorted(lang.items())),
        "model_type": "multi_modality",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "vision_config": {"cls": "CLIPVisionTower", "model_type": "vision",
                          "params": {"image_size": a["vision"][2], "model_name": "siglip_large_patch16_384",
                                     "select_feature": "same", "select_layer": -1}},
    }


def janus_text_files(ids: dict, n_bpe: int, image_size: int) -> list:
    T = tokenizers_out
    return [
        File("preprocessor_config.json", "text", text=_json({
            "background_color": [127, 127, 127], "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "VLMImageProcessor", "image_size": image_size,
            "image_std": [0.5, 0.5, 0.5], "min_size": 14, "processor_class": "VLChatProcessor",
            "rescale_factor": 0.00392156862745098})),
        File("processor_config.json", "text", text=_json({
            "add_special_token": False, "ignore_id": -100, "image_tag": "<image_placeholder>",
            "mask_prompt": True, "num_image_tokens": (image_size // 16) ** 2,
            "processor_class": "VLChatProcessor", "sft_format": "deepseek"})),
        File("special_tokens_map.json", "text", text=_json({
            "additional_special_tokens": T.JANUS_ADDITIONAL, "bos_token": T.BOS, "eos_token": T.EOS,
            "pad_token": T.PAD})),
        File("tokenizer.json", "text", text=T.janus_tokenizer(n_bpe, ids)),
        File("tokenizer_config.json", "text", text=_json({
            "bos_token": T.BOS, "clean_up_tokenization_spaces": False, "eos_token": T.EOS,
            "model_max_length": 16384, "pad_token": None, "tokenizer_class": "LlamaTokenizerFast",
            "unk_token": None, "use_default_system_prompt": True})),
    ]


def janus_release(model: str, tiny: bool) -> Release:
    full = JANUS_FULL[model]
    a = JANUS_TINY if tiny else full
    tensors = tables.janus(a)
    if tiny:
        T = tokenizers_out
        names = [T.BOS, T.EOS, T.PAD, "<begin_of_image>", "<end_of_image>", *T.JANUS_ADDITIONAL]
        ids, n_bpe = {s: JANUS_TINY_BPE + i for i, s in enumerate(names)}, JANUS_TINY_BPE
    else:
        ids, n_bpe = tokenizers_out.JANUS_IDS, 100000
    files = [File("config.json", "text", text=_json(janus_config(a, model == "janus-pro-1b" or tiny)))]
    files += janus_text_files(ids, n_bpe, a["vision"][2])
    if model == "janus-pro-1b":
        files.append(File("pytorch_model.bin", "torch", tensors))
    else:
        full_t = tables.janus(full)
        ends = hf_shard_ends([t.nbytes for t in full_t], HF_MAX_SHARD)
        parts = (split_by_fraction(tensors, _fractions(full_t, ends)) if tiny
                 else [full_t[s:e] for s, e in zip([0] + ends[:-1], ends)])
        n = len(parts)
        shards = [File(f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin", "torch", p) for i, p in enumerate(parts)]
        files += shards + [File("pytorch_model.bin.index.json", "text", text=_index(shards))]
    notes = ["the VQ-16 (gen_vision_model) is full size even with --tiny: deepseek's code builds it "
             "from no config"] if tiny else []
    return Release(model, tiny, files, notes)


# ---- LlamaGen ----------------------------------------------------------------------------------

def llamagen_release(tiny: bool) -> Release:
    if tiny:
        gpt = tables.llamagen_gpt(2, 64)
        vq = nets.llamagen_vq("", "f32", ch=32, z=32)
    else:
        gpt = tables.llamagen_gpt(36, 1280)
        vq = nets.llamagen_vq("", "f32")
    files = [File("c2i_XL_384.pt", "torch", gpt, wrap="model"),
             File("vq_ds16_c2i.pt", "torch", vq, wrap="model")]
    notes = ["--tiny GPT: 2 layers of width 64 (4 heads of 16: give the converter --n-head 4)"] if tiny else []
    return Release("llamagen-xl", tiny, files, notes)


# ---- VAR ---------------------------------------------------------------------------------------

def var_release(tiny: bool) -> Release:
    depth = 2 if tiny else 30
    vae = nets.var_vqvae("f32", ch=32) if tiny else nets.var_vqvae("f32")
    files = [File("var_d30.pth", "torch", tables.var(depth, VAR_PATCH_NUMS)),
             File("vae_ch160v4096z32.pth", "torch", vae)]
    return Release("var-d30", tiny, files)


# ---- Infinity and flan-t5-xl ---------------------------------------------------------------------

T5_FULL = dict(vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_decoder_layers=24,
               num_heads=32, relative_attention_num_buckets=32, pieces=32000, extra=100)
T5_TINY = dict(vocab_size=384, d_model=256, d_kv=32, d_ff=512, num_layers=2, num_decoder_layers=2,
               num_heads=4, relative_attention_num_buckets=32, pieces=256, extra=100)


def t5_config(c: dict) -> dict:
    return {
        "architectures": ["T5ForConditionalGeneration"], "d_ff": c["d_ff"], "d_kv": c["d_kv"],
        "d_model": c["d_model"], "decoder_start_token_id": 0, "dense_act_fn": "gelu_new",
        "dropout_rate": 0.1, "eos_token_id": 1, "feed_forward_proj": "gated-gelu",
        "initializer_factor": 1.0, "is_encoder_decoder": True, "is_gated_act": True,
        "layer_norm_epsilon": 1e-06, "model_type": "t5", "n_positions": 512,
        "num_decoder_layers": c["num_decoder_layers"], "num_heads": c["num_heads"],
        "num_layers": c["num_layers"], "output_past": True, "pad_token_id": 0,
        "relative_attention_max_distance": 128,
        "relative_attention_num_buckets": c["relative_attention_num_buckets"],
        "task_specific_params": {
            "summarization": {"early_stopping": True, "length_penalty": 2.0, "max_length": 200,
                              "min_length": 30, "no_repeat_ngram_size": 3, "num_beams": 4,
                              "prefix": "summarize: "},
            "translation_en_to_de": {"early_stopping": True, "max_length": 300, "num_beams": 4,
                                     "prefix": "translate English to German: "},
            "translation_en_to_fr": {"early_stopping": True, "max_length": 300, "num_beams": 4,
                                     "prefix": "translate English to French: "},
            "translation_en_to_ro": {"early_stopping": True, "max_length": 300, "num_beams": 4,
                                     "prefix": "translate English to Romanian: "}},
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.23.1",
        "use_cache": True, "vocab_size": c["vocab_size"],
    }


def t5_files(tiny: bool) -> list:
    c = T5_TINY if tiny else T5_FULL
    tensors = tables.t5(c)
    # the shards follow the pytorch_model shards they were converted from: transformers split
    # the state dict counting the tied embed_tokens twice more, then they were dropped
    full = tables.t5(T5_FULL)
    emb = full[0].nbytes
    sizes = [t.nbytes for t in full]
    at_decoder = next(i for i, t in enumerate(full) if t.name.startswith("decoder."))
    sizes_with_tied = sizes[:1] + [emb] + sizes[1:at_decoder] + [emb] + sizes[at_decoder:]
    ends = [e - (1 if e > 1 else 0) - (1 if e > at_decoder + 1 else 0)
            for e in hf_shard_ends(sizes_with_tied, HF_MAX_SHARD)]
    parts = (split_by_fraction(tensors, _fractions(full, ends)) if tiny
             else [full[s:e] for s, e in zip([0] + ends[:-1], ends)])
    n = len(parts)
    shards = [File(f"flan-t5-xl/model-{i + 1:05d}-of-{n:05d}.safetensors", "safetensors", p,
                   metadata={"format": "pt"}) for i, p in enumerate(parts)]
    extra = [f"<extra_id_{i}>" for i in range(c["extra"])]
    return [
        File("flan-t5-xl/config.json", "text", text=_json(t5_config(c))),
        File("flan-t5-xl/generation_config.json", "text", text=_json({
            "_from_model_config": True, "decoder_start_token_id": 0, "eos_token_id": 1,
            "pad_token_id": 0, "transformers_version": "4.27.0.dev0"})),
        *shards,
        File("flan-t5-xl/model.safetensors.index.json", "text", text=_index(shards)),
        File("flan-t5-xl/special_tokens_map.json", "text", text=_json({
            "additional_special_tokens": extra, "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"})),
        File("flan-t5-xl/tokenizer.json", "text", text=tokenizers_out.t5_tokenizer(c["pieces"], c["extra"])),
        File("flan-t5-xl/tokenizer_config.json", "text", text=_json({
            "additional_special_tokens": extra, "eos_token": "</s>", "extra_ids": c["extra"],
            "model_max_length": 512, "name_or_path": "google/t5-v1_1-xl", "pad_token": "<pad>",
            "sp_model_kwargs": {}, "special_tokens_map_file": None, "tokenizer_class": "T5Tokenizer",
            "unk_token": "<unk>"})),
    ]


def infinity_release(model: str, tiny: bool) -> Release:
    eight = model == "infinity-8b"
    mid = model == "infinity-mid"
    t5c = T5_TINY if tiny or mid else T5_FULL
    if mid and not tiny:
        depth, C, H = 16, 1024, 16
        vae = nets.infinity_bsq_vae("f32")
    elif tiny:
        depth, C, H = 8, 128, 2
        vae = (nets.infinity_bsq_vae("f32", base=32, ch_mult=(1, 2, 4, 4), codebook_dim=14, patch=8) if eight
               else nets.infinity_bsq_vae("f32", base=32))
    elif eight:
        depth, C, H = 40, 3584, 28
        vae = nets.infinity_bsq_vae("f32", ch_mult=(1, 2, 4, 4), codebook_dim=14, patch=8)
    else:
        depth, C, H = 32, 2048, 16
        vae = nets.infinity_bsq_vae("f32")
    bits = 4 * 14 if eight else 32
    tr = tables.infinity(depth, C, H, 8, bits, text_ch=t5c["d_model"])
    if eight:
        # 4 shards of two block chunks each (10 blocks, 8.22 GB); the non-block tensors go with
        # the last (8.83 GB), which is what the released shard sizes add up to
        blocks = [t for t in tr if t.name.startswith("block_chunks.")]
        rest = [t for t in tr if not t.name.startswith("block_chunks.")]
        parts = [[t for t in blocks if int(t.name.split(".")[1]) // 2 == k] for k in range(4)]
        parts[-1] += rest
        shards = [File(f"infinity_8b_weights/model-{k + 1:05d}-of-00004.safetensors", "safetensors", p,
                       metadata={"format": "pt"}) for k, p in enumerate(parts)]
        files = shards + [File("infinity_8b_weights/model.safetensors.index.json", "text", text=_index(shards)),
                          File("infinity_vae_d56_f8_14_patchify.pth", "torch", vae, wrap="vae")]
    else:
        files = [File("infinity_2b_reg.pth", "torch", tr),
                 File("infinity_vae_d32reg.pth", "torch", vae, wrap="vae")]
    return Release(model, tiny, files + t5_files(tiny or mid))


def release(model: str, tiny: bool = False) -> Release:
    if model.startswith("janus"):
        return janus_release(model, tiny)
    if model == "llamagen-xl":
        return llamagen_release(tiny)
    if model == "var-d30":
        return var_release(tiny)
    if model.startswith("infinity"):
        return infinity_release(model, tiny)
    raise KeyError(model)


# Parameter counts stated by the model cards or measured on the official classes (NOTES.md):
# the tests check the tables against them.
KNOWN_PARAMS = {
    "infinity-2b": 2_204_564_032,
    "infinity-8b": 8_375_791_824,
}
