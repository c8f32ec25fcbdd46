"""Generate a tiny random-weight Qwen3-style chat model that real vLLM can serve on the CPU.

Run with the engine venv's interpreter (it needs torch, transformers and tokenizers; see venv.sh):

    ~/.cache/warmroute/e2e-venv/bin/python tests/e2e/make_model.py            # cached; prints the model dir
    ~/.cache/warmroute/e2e-venv/bin/python tests/e2e/make_model.py --out DIR  # (re)generate into DIR

Nothing is downloaded. Weights are random (torch.manual_seed), so replies are gibberish; what matters is that
the engine does real prefill work (prefix caching is visible and worth something) and that the wire format —
ChatML, `<think>` reasoning, thinking budgets — behaves like a real Qwen3 deployment. Everything is
deterministic: the same spec and generator source give byte-identical files, and the cached directory is named
after a hash of both, so a rerun skips generation and an edited generator gets a fresh directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_PAD = ("<|im_end|>", "<|endoftext|>")
# Not "special" (like Qwen3): they stay in decoded text, which the reasoning parser relies on.
THINK_TOKENS = ("<think>", "</think>")
# Reserved so a tiny vision-language model can later share this tokenizer.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")

# ChatML. Thinking is on unless `enable_thinking` is false (vLLM's qwen3 parser makes the same assumption):
# on, the generation prompt opens `<think>\n`; off, it closes an empty think block as Qwen3 does.
# Messages are rendered verbatim (no reasoning stripped from earlier assistant turns), so a later turn's
# prompt extends the earlier one and `continue_final_message` finds the final message in the output.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}"
    "{{- '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_WORD_LIST = """
the of and to in is that for it as was with be by on not he this are or his from at which but have
an they you were her she there been one all we their has would when if so no will more about can
said them some could into than other time only new these two may first then do any like my now over
such our man me even most made after also did many off before must well back through years much
where your way down should because each just those people how too little state good very make world
still own see men work long here get both between life being under never day same another know while
last might us great old year since against come go came right used take three engine cache prefix
token request route gateway model prompt reply stream budget think reason image vector server client
latency queue memory
"""
WORDS = tuple(_WORD_LIST.split())
PUNCT = (".", ".", ".", ",", ",", "?", "!", ":", ";")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything that decides the generated files. Hashed into the cache directory name."""

    vocab_size: int = 1024  # BPE vocabulary, special tokens included; think tokens are added on top
    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64  # vLLM's CPU attention refuses 16; 64 works
    intermediate_size: int = 1536
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    dtype: str = "bfloat16"
    seed: int = 0
    corpus_sentences: int = 40_000


SPECS = {"tiny-chat": ModelSpec()}


def spec_digest(spec: ModelSpec) -> str:
    h = hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())  # any change to the generator gives a new directory
    return h.hexdigest()[:12]


def cache_root() -> Path:
    default = Path.home() / ".cache" / "warmroute"
    return Path(os.environ.get("WARMROUTE_E2E_CACHE", default)) / "models"


def corpus(spec: ModelSpec) -> list[str]:
    """Seeded pseudo-English plus digits, code-ish and ChatML-ish lines, so BPE learns useful merges."""
    rng = random.Random(spec.seed)
    lines = []
    for i in range(spec.corpus_sentences):
        words = rng.choices(WORDS, k=rng.randint(4, 18))
        sentence = " ".join(words).capitalize() + rng.choice(PUNCT)
        if i % 7 == 0:
            sentence += f" {rng.randint(0, 99999)} {rng.random():.3f}"
        if i % 11 == 0:
            sentence = f'{{"role": "user", "content": "{sentence}"}}'
        if i % 13 == 0:
            sentence = f"def {rng.choice(WORDS)}_{rng.choice(WORDS)}(x):\n    return x + {rng.randint(1, 9)}"
        lines.append(sentence)
    return lines


def build_tokenizer(spec: ModelSpec) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *VISION_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def write_model(spec: ModelSpec, out: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(spec),
        eos_token=EOS_PAD[0],
        pad_token=EOS_PAD[1],
        # Listed so decoding with skip_special_tokens (vLLM's default) drops them, as with real Qwen.
        extra_special_tokens=[t for t in (*SPECIAL_TOKENS, *VISION_TOKENS) if t not in EOS_PAD],
        model_max_length=spec.max_position_embeddings,
        chat_template=CHAT_TEMPLATE,
    )
    tok.save_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *THINK_TOKENS)}
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, spec.dtype)).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    check_tokenizer(out, ids)


def check_tokenizer(out: Path, ids: dict[str, int]) -> None:
    """Each marker is one token, special ones vanish when decoding, and both thinking modes render."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    for text, token_id in ids.items():
        got = tok.encode(text, add_special_tokens=False)
        if got != [token_id]:
            raise SystemExit(f"make_model: {text!r} encodes to {got}, expected [{token_id}]")
    sample = "".join(("a", *SPECIAL_TOKENS, *VISION_TOKENS, *THINK_TOKENS, "b"))
    decoded = tok.decode(tok.encode(sample, add_special_tokens=False), skip_special_tokens=True)
    if decoded != "a" + "".join(THINK_TOKENS) + "b":
        raise SystemExit(f"make_model: special tokens survive decoding: {decoded!r}")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    if not (on.endswith("<|im_start|>assistant\n<think>\n") and off.endswith("</think>\n\n")):
        raise SystemExit(f"make_model: unexpected chat template output:\n{on!r}\n{off!r}")


def generate(spec: ModelSpec, out: Path) -> None:
    started = time.monotonic()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_model(spec, tmp)
        meta = {"spec": dataclasses.asdict(spec), "digest": spec_digest(spec)}
        (tmp / "warmroute-model.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if out.exists():  # --out into an existing dir, or a concurrent run finished first
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: a cached directory is always complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"make_model: wrote {out} in {time.monotonic() - started:.1f}s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="tiny-chat", choices=sorted(SPECS))
    parser.add_argument("--out", type=Path, help="generate into this directory (default: the cache)")
    args = parser.parse_args(argv)
    spec = SPECS[args.name]
    if args.out is not None:
        generate(spec, args.out)
        out = args.out
    else:
        out = cache_root() / f"{args.name}-{spec_digest(spec)}"
        if out.is_dir():
            print(f"make_model: cached {out}", file=sys.stderr)
        else:
            generate(spec, out)
    print(out.resolve())  # the only line on stdout: callers read it
    return 0


if __name__ == "__main__":
    sys.exit(main())
