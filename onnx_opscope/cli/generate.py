"""`opscope generate`: run a decoder's KV-cache loop and record each prefill and decode step's sketches."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import OpscopeError
from ..run.generate import generate
from ..run.prompt import Eos, default_eos, load_tokenizer, prompt_ids_of, text_of, tokenizer_path
from .options import (
    add_output_argument,
    add_quiet_argument,
    add_runtime_arguments,
    add_tap_arguments,
    csv_items,
    runtime_config_from_args,
    selection_from_args,
    sketch_epilog,
    sketch_options_from_args,
    sketches_from_args,
)
from .record import parse_tol

EPILOG = """\
exit codes: 0 done, 2 bad input (file, option, prompt, a model whose cache layout is not recognised),
3 parity gate failed, 130 interrupted (the finished steps are kept).

examples:
  opscope generate decoder.onnx --tokens 32 --steps 64 -o gen.parquet
  opscope generate decoder.onnx --prompt "What is the capital of France?" --chat --steps 16 -o gen.parquet
  opscope generate decoder.onnx --prompt-ids 1,9690,198 --steps 16 --sample --seed 3 -o gen.parquet
  opscope generate decoder.onnx --prompt-file prompt.txt --steps 256 --every 8 --kind attn -o attn.parquet
  opscope generate decoder.onnx --tokens 8 --steps 16 --plain     # the plain loop: tokens and timings only

The decoder needs input_ids, optionally attention_mask / position_ids, and past_key_values.{i}.key/value
inputs each with a present.{i}.key/value output (transformers / optimum exports). The table is
`record`'s plus two columns: phase (prefill, decode) and position (the step's first token's position).

The loop stops once every row generated the eos: by default the one the model's files name (eos_token_id
of a generation_config.json beside it, else the eos_token of the tokenizer_config.json beside the tokenizer);
--eos-id ID[,ID...] sets it, --no-eos runs all --steps. The summary says which eos and where it came from.

A text prompt (--prompt, or a --prompt-file that is not all integers) is encoded by the Hugging Face
tokenizer.json beside the model, or --tokenizer FILE (pip install 'onnx-opscope[text]'); with one
there the summary shows the generated text, else its ids. A --prompt-file whose every whitespace-separated
word is an integer is token ids, as before: give such a text with --prompt "$(cat FILE)".
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate",
        help="generate tokens with a decoder's KV cache, recording prefill and decode steps",
        description="Feed a prompt, then each step's present.* back as past_key_values.*, generating --steps "
        "tokens (greedy, or --sample), and record every step's sketches into a tidy table with phase "
        "and position columns. Beside the table: <stem>.sites.csv and <stem>.run.json.",
        epilog=EPILOG + "\n" + sketch_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="the decoder .onnx model")
    group = p.add_argument_group("prompt", "one of --tokens, --prompt-ids, --prompt, --prompt-file")
    add_prompt_arguments(group, group.add_mutually_exclusive_group(required=True))
    g = p.add_argument_group("generation")
    g.add_argument("--steps", type=int, default=16, metavar="N", help="tokens to generate (default: 16)")
    g.add_argument("--sample", action="store_true", help="sample from softmax(logits / T) instead of greedy")
    g.add_argument("--temperature", type=float, default=1.0, metavar="T", help="with --sample (default: 1)")
    g.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of --tokens and --sample (default: 0)"
    )
    eos = g.add_mutually_exclusive_group()
    eos.add_argument("--eos-id", default=None, metavar="ID[,ID...]",
                     help="stop once every row generated one of these ids (default: the eos the model's files name: "
                     "eos_token_id of generation_config.json beside it, else eos_token of tokenizer_config.json)")  # fmt: skip
    eos.add_argument("--no-eos", action="store_true", help="no eos: run all --steps")
    g.add_argument(
        "--every",
        type=int,
        default=1,
        metavar="N",
        help="record the prefill and one decode step in N (default: every step; decoding a step's taps on the "
        "host costs more than the step itself on CPU)",
    )
    add_output_argument(p, "the table to write: .parquet or .csv", default=Path("generate.parquet"))
    p.add_argument("--plain", action="store_true", help="run the plain model: no taps, no table")
    p.add_argument(
        "--run-id", default=None, help="label of this run in the table (default: model name + time)"
    )
    p.add_argument("--no-parity", action="store_true", help="skip the parity gate on the prefill")
    p.add_argument(
        "--parity-tol", default=None, metavar="RTOL[,ATOL]", help="parity tolerance, as for record"
    )
    add_quiet_argument(p)
    add_runtime_arguments(p)
    add_tap_arguments(p)
    return p


def add_prompt_arguments(group: argparse._ArgumentGroup, one: argparse._MutuallyExclusiveGroup) -> None:
    """The prompt flags, spelt alike by `generate` and --generate: `one` of --tokens / --prompt-ids / --prompt /
    --prompt-file, and in `group` the --tokenizer and --chat of a text prompt. Read back by `prompt_from_args`."""
    one.add_argument(
        "--tokens", type=int, metavar="N", help="a random prompt of N token ids (seeded by --seed)"
    )
    one.add_argument("--prompt-ids", metavar="ID,ID,...", help="the prompt's token ids, comma-separated")
    one.add_argument("--prompt", metavar="TEXT", help="the prompt as text, encoded by the model's tokenizer")
    one.add_argument("--prompt-file", type=Path, metavar="FILE",
                     help="a file of token ids (whitespace-separated integers), else of text (its last newline "
                     "dropped)")  # fmt: skip
    group.add_argument("--tokenizer", type=Path, metavar="FILE",
                       help="the Hugging Face tokenizer.json of a text prompt and of the generated text (default: "
                       "tokenizer.json beside the model)")  # fmt: skip
    group.add_argument("--chat", action="store_true",
                       help="wrap the text prompt in the chat_template of the tokenizer_config.json beside the "
                       "tokenizer, as one user message with the assistant's turn opened (needs jinja2)")  # fmt: skip


def prompt_from_args(args: argparse.Namespace) -> list[int] | None:
    """The prompt ids of --prompt-ids, --prompt or --prompt-file (None for --tokens)."""
    text, ids, where = None, None, "--prompt-ids"
    if args.prompt_ids is not None:
        joined = ",".join(csv_items([args.prompt_ids]))
        ids = joined.split(",") if joined else []
    elif args.prompt is not None:
        text = args.prompt
    elif args.prompt_file is not None:
        try:
            content, where = args.prompt_file.read_text(), str(args.prompt_file)
        except (OSError, UnicodeDecodeError) as exc:
            raise OpscopeError(
                f"{args.prompt_file}: cannot read the prompt ({exc.__class__.__name__})"
            ) from None
        words = content.split()
        if not words:
            raise OpscopeError(f"{where}: the prompt is empty", hint="write token ids or text into it")
        if all(_is_int(w) for w in words):
            ids = words
        else:
            text = content.removesuffix("\n")
    if args.chat and text is None:
        raise OpscopeError(
            "--chat wraps a text prompt: give it with --prompt TEXT or a --prompt-file of text"
        )
    if text is not None:
        return prompt_ids_of(text, args.model, tokenizer=args.tokenizer, chat=args.chat)
    if ids is None:
        return None
    bad = next((t for t in ids if not _is_int(t)), None)
    if bad is not None or not ids:
        raise OpscopeError(
            f"{where}: expected token ids (integers), got {bad!r}" if bad else f"{where}: no token ids",
            hint="a text prompt goes with --prompt TEXT",
        )
    return [int(t) for t in ids]


def _is_int(word: str) -> bool:
    return word.lstrip("-").isdigit()


def output_tokenizer(args: argparse.Namespace) -> Path | None:
    """The tokenizer that shows the generated text: --tokenizer (checked now, before the run), else the one
    beside the model when it loads (a text prompt has loaded it already); None: the ids are shown."""
    try:
        path = tokenizer_path(args.model, args.tokenizer)
        load_tokenizer(path)
    except OpscopeError:
        if args.tokenizer is not None:
            raise
        return None
    return path


def generated_line(row: list[int], model: Path, tokenizer: Path | None, width: int = 200) -> str:
    """One row's summary: its text (the first `width` characters, repr-escaped onto one line), else its ids."""
    if tokenizer is None:
        return "generated: " + " ".join(map(str, row))
    text = text_of(row, model, tokenizer=tokenizer)
    return f"generated: {text[:width]!r}{' ...' if len(text) > width else ''}"


def eos_from_args(args: argparse.Namespace) -> Eos | None:
    """The eos the loop stops at: --eos-id, none with --no-eos, else the one the model's files name
    (`prompt.default_eos`), else none."""
    if args.no_eos:
        return None
    if args.eos_id is not None:
        words = csv_items([args.eos_id])
        bad = next((w for w in words if not w.isdigit()), None)
        if bad is not None or not words:
            raise OpscopeError(f"--eos-id {args.eos_id!r}: expected token ids (0 or more), comma-separated",
                               hint="--no-eos runs all --steps")  # fmt: skip
        return Eos(tuple(dict.fromkeys(int(w) for w in words)), "--eos-id")
    return default_eos(args.model, args.tokenizer)


def eos_line(eos: Eos | None, args: argparse.Namespace, steps: int) -> str:
    """The summary's eos line: which ids, where they came from, and whether the loop stopped at one."""
    if eos is None:
        why = "--no-eos" if args.no_eos else "the model's files name none; --eos-id ID sets one"
        return f"eos: none ({why})"
    stopped = f"; stopped at it after {steps} of {args.steps} steps" if steps < args.steps else ""
    return f"eos: {eos.describe(args.model, args.tokenizer)}{stopped}"


def run(args: argparse.Namespace) -> int:
    prompt = prompt_from_args(args)
    eos = eos_from_args(args)
    tokenizer = None if args.quiet else output_tokenizer(args)
    common = dict(tokens=args.tokens, steps=args.steps, sample=args.sample, temperature=args.temperature,
                  seed=args.seed, eos_id=eos.ids if eos else None, runtime=runtime_config_from_args(args))  # fmt: skip
    if args.plain:
        result = generate(args.model, prompt, **common)
    else:
        result = generate(
            args.model,
            prompt,
            **common,
            out=args.output,
            every=args.every,
            sites=selection_from_args(args),
            sketches=sketches_from_args(args),
            options=sketch_options_from_args(args),
            placement=args.placement,
            run_id=args.run_id,
            parity=not args.no_parity,
            parity_tol=parse_tol(args.parity_tol),
        )
    if args.quiet:
        return 0
    prefill, decode = result.step_seconds[0], result.step_seconds[1:]
    per_token = f", decode {1e3 * sum(decode) / len(decode):.1f} ms/token" if decode else ""
    timing = f"prefill {result.prompt_len} tokens {1e3 * prefill:.1f} ms{per_token}"
    if result.table is None:
        print(f"{args.model}: {result.steps} steps in {result.seconds:.1f}s; {timing}")
    else:
        par = result.parity
        gate = "skipped" if par is None else f"ok (max rel {par.max_rel:.2g} on {par.worst_output!r})"
        print(
            f"{result.table}: {result.rows} rows, {result.steps} steps, {len(result.manifest.sites)} sites on "
            f"{', '.join(result.runtime['providers'])} in {result.seconds:.1f}s; {timing}; parity {gate}"
        )
        print(f"sites: {result.sites}\nrun: {result.run}")
    print(eos_line(eos, args, result.steps))
    for row in result.generated.tolist():
        print(generated_line(row, args.model, tokenizer))
    return 0


def add_generation_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--generate, its prompt (--tokens / --prompt-ids / --prompt / --prompt-file, --tokenizer, --chat, as
    `generate` spells them) and --steps: for the commands that can run a decoder's KV loop instead of their
    feeds (parity, calibrate). A random prompt is seeded by --seed. Read back by `generation_from_args`."""
    g = parser.add_argument_group("generation", what)
    g.add_argument("--generate", action="store_true", help=what)
    add_prompt_arguments(g, g.add_mutually_exclusive_group())
    g.add_argument(
        "--steps", type=int, default=None, metavar="N", help="tokens to generate: the prefill and N - 1 decode "
        "steps (default: 16)"
    )  # fmt: skip


def generation_from_args(args: argparse.Namespace) -> dict | None:
    """{prompt_ids, tokens, steps, seed} of --generate (None without it); a prompt flag without it is an error."""
    prompts = [f for f, v in (("--tokens", args.tokens), ("--prompt-ids", args.prompt_ids), ("--prompt", args.prompt),
                              ("--prompt-file", args.prompt_file)) if v is not None]  # fmt: skip
    extras = [f for f, v in (("--steps", args.steps), ("--tokenizer", args.tokenizer)) if v is not None]
    if not args.generate:
        given = [*prompts, *extras, *(["--chat"] if args.chat else [])]
        if given:
            raise OpscopeError(
                f"{given[0]} goes with --generate", hint="add --generate to run a decoder's KV loop"
            )
        return None
    if not prompts:
        raise OpscopeError(
            "--generate needs a prompt: --tokens N, --prompt-ids ID,..., --prompt TEXT or --prompt-file FILE"
        )
    steps = 16 if args.steps is None else args.steps
    return {"prompt_ids": prompt_from_args(args), "tokens": args.tokens, "steps": steps, "seed": args.seed}
