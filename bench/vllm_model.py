"""A small random Llama and a word-level tokenizer, made locally (no model hub).

    python bench/vllm_model.py DIR      # writes DIR (config, safetensors, tokenizer)

Run with the vLLM venv's Python (transformers, tokenizers, torch). Same seed,
same files: the weights are drawn from torch's generator seeded with SEED;
the tokenizer's vocabulary is the words "w0".."w{VOCAB-5}" and four special
tokens. The shape is chosen for TP=2 on a 2-core machine: a decode step is a
few milliseconds of matmuls per rank, and its all-reduces carry hidden x
bf16 = 2 KB per sequence (one per attention and one per MLP of each layer,
plus the vocabulary-parallel embedding's), the size range of real decode
all-reduces (10 KB at hidden 5120). A directory already holding this
model (its stamp file matches SHAPE) is left as it is.
"""

from __future__ import annotations

import json
import os
import sys
import types

SEED = 0
SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1024)
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
STAMP = "harmpi-model.json"


def _help_on_rank0(ctx, _param, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    import click  # noqa: PLC0415

    if (os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK") or "0") == "0":
        click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


def help_option():
    """-h/--help for the vLLM scripts: printed by rank 0 only under an MPI
    launcher (click's own prints once per rank)."""
    import click  # noqa: PLC0415 - in both venvs

    return click.option("-h", "--help", is_flag=True, expose_value=False, is_eager=True,
                        callback=_help_on_rank0, help="Show this message and exit.")


def comma_list(allowed, what):
    """A click callback: a comma list whose items are all in ``allowed``
    (``what`` names an item in the error)."""
    import click  # noqa: PLC0415 - in both venvs

    def check(_ctx, _param, value):
        items = [x for x in value.split(",") if x]
        for x in items:
            if x not in allowed:
                raise click.BadParameter(f"unknown {what} {x!r} ({', '.join(allowed)})")
        return items
    return check


def parse(command, argv):
    """The namespace a click ``command`` (whose callback returns
    ``types.SimpleNamespace(**options)``) makes of ``argv`` (None:
    sys.argv); --help exits 0 and a bad option exits 2 with click's usage
    error, as the other bench commands do."""
    import click  # noqa: PLC0415

    try:
        got = command.main(args=argv, standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    if not isinstance(got, types.SimpleNamespace):  # --help: ctx.exit()'s code
        sys.exit(got or 0)
    return got


def prompts(count: int, length: int) -> list[str]:
    """``count`` deterministic prompts of ``length`` words each."""
    words = SHAPE["vocab_size"] - len(SPECIAL)
    return [" ".join(f"w{(97 * i + 31 * j * (i + 1)) % words}" for j in range(length))
            for i in range(count)]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for i in range(SHAPE["vocab_size"] - len(SPECIAL)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def make(path: str) -> str:
    """Write the model and tokenizer to ``path`` (unless already there); return it."""
    stamp = os.path.join(path, STAMP)
    want = {"seed": SEED, **SHAPE}
    if os.path.isfile(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return path
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(SEED)
    config = LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    with open(stamp, "w") as f:
        json.dump(want, f)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/vllm_model.py DIR")
    print(make(sys.argv[1]))
