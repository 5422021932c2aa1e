"""Build a tiny random-weight Llama + byte-level BPE tokenizer, fully offline.

Used by the vLLM end-to-end tests (see the shared reference vllm-cpu-engine.md §3).
No vllm / pytest import here; torch, transformers and tokenizers are imported lazily
inside ``build_tiny_model`` (they live in the vLLM venv, ``.venv-vllm``).

Shape: LlamaConfig(vocab 512, hidden 128, intermediate 256, 2 layers, 4 heads, 4 kv heads)
-> head_dim 32 (the CPU attention backend refuses head_dim 16). Saved in fp32 (~1.8 MB).
Deterministic: fixed torch seed, fixed tokenizer corpus; two builds give identical files.

``build_tiny_model(path, **HALF_B)`` builds a model of realistic shape instead (a
0.4B-parameter Llama shaped like Qwen2-0.5B: 24 layers, hidden 896, 14 query and 2 KV heads
of 64, grouped-query attention; vocabulary 32000; bfloat16, ~0.8 GB), for benchmarks whose
prefill must cost what it costs with real models. Same tokenizer (prompts are token ids).
"""

from __future__ import annotations

import json
import os

# Model geometry, exported so tests can compute expected KV sizes.
VOCAB_SIZE = 512
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS  # 32
MAX_POSITION_EMBEDDINGS = 2048
SEED = 1234

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Shared memory lets co-located processes exchange KV cache blocks.",
    "A prefix cache hit avoids recomputing attention keys and values.",
    "Large language models generate one token at a time.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "kvshm keeps offloaded blocks in one POSIX shared-memory segment.",
    "vLLM schedules requests, allocates blocks and runs the model.",
    "Hello world! How are you today? I am fine, thank you.",
] * 4

_MARKER = ".kvshm_tiny_model.json"


# A realistic shape (Qwen2-0.5B's, as a Llama): ~0.4B parameters, random weights.
HALF_B = {
    "vocab_size": 32000,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "max_position_embeddings": 32768,
    "dtype": "bfloat16",
}


def _params(**shape) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_layers": NUM_LAYERS,
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "dtype": "float32",
        "seed": SEED,
        "version": 1,
        **shape,
    }


def build_tiny_model(path: str | os.PathLike, **shape) -> str:
    """Build (or reuse, if already built with the same parameters) the tiny model (or one
    of ``shape``, e.g. ``HALF_B``) in directory ``path`` and return its absolute path."""
    path = os.path.abspath(os.fspath(path))
    marker = os.path.join(path, _MARKER)
    params = _params(**shape)
    if os.path.exists(marker):
        try:
            with open(marker) as f:
                if json.load(f) == params:
                    return path
        except (OSError, ValueError):
            pass
    os.makedirs(path, exist_ok=True)

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # --- tokenizer: byte-level BPE trained on a fixed corpus (deterministic) ---
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 120,  # stay well below the model vocab
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=params["max_position_embeddings"],
    )
    fast.save_pretrained(path)

    # --- model: random Llama, fixed seed, fp32 ---
    dtype = params["dtype"]
    cfg = LlamaConfig(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"],
        max_position_embeddings=params["max_position_embeddings"],
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    saved_rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(params["seed"])
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    finally:
        torch.random.set_rng_state(saved_rng)
    model.save_pretrained(path, safe_serialization=True)

    with open(marker, "w") as f:
        json.dump(params, f)
    return path


if __name__ == "__main__":  # python tests/vllm_support/tiny_model.py DIR
    import sys
    import time

    t = time.time()
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
    print(f"built in {time.time() - t:.1f}s")
