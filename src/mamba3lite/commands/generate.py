"""`mamba3lite generate`: sample text from a checkpoint (prefill + recurrent decode), streamed.

    mamba3lite generate --checkpoint-dir mamba3lite-quickstart/run --prompt "def " --max-new-tokens 200

Loads the newest verified checkpoint of the run (or exactly `--step N`) with the config and tokenizer
saved in it, streams the text to stdout as it is produced, stops at EOS or after --max-new-tokens, and
reports tokens/s on stderr (so `> file` captures only the text). Same --seed, same text. Token healing
(`mamba3lite.token_healing`) is on unless --no-token-healing: "def " continues as "def main(", not as
the whitespace that follows a lone " " token.
"""

from __future__ import annotations

import argparse
import sys

from mamba3lite.commands.options import add_checkpoint_options

HELP = "sample text from a checkpoint (prefill + recurrent decode)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_options(parser)
    parser.add_argument(
        "--prompt", default="", metavar="TEXT", help="text to continue (default: empty, a new document)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=200, metavar="N", help="stop after N new tokens (default 200)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        metavar="T",
        help="softmax temperature; 0 = greedy (default 0.8)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=50,
        metavar="K",
        help="sample among the K most likely tokens (default 50; 0 = off)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="nucleus sampling: smallest set with probability >= P",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same text (default 0)")
    parser.add_argument(
        "--no-token-healing",
        dest="token_healing",
        action="store_false",
        help="feed the prompt's tokens as they are (default: back up its last token(s) and have the first "
        "new tokens spell them again, so a prompt ending in a space or half a word continues naturally)",
    )
    stream = parser.add_mutually_exclusive_group()
    stream.add_argument(
        "--stream",
        dest="stream",
        action="store_true",
        default=True,
        help="print text as it is produced (default)",
    )
    stream.add_argument("--no-stream", dest="stream", action="store_false", help="print the text at the end")


def run(args: argparse.Namespace) -> int:
    from mamba3lite.generation import check_sampling_args, generate_text
    from mamba3lite.pretrained import load_pretrained, resolve_device

    top_k = None if args.top_k == 0 else args.top_k
    check_sampling_args(args.max_new_tokens, args.temperature, top_k, args.top_p, args.seed)
    loaded = load_pretrained(args.checkpoint_dir, args.step, device=resolve_device(args.device))
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)
    tok = loaded.load_tokenizer()
    print(
        f"[step {loaded.step} of {loaded.run_dir}, {loaded.tokens_seen:,} tokens seen; seed {args.seed}]",
        file=sys.stderr,
        flush=True,
    )

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if args.stream:
        show(args.prompt)
    result = generate_text(
        loaded.model,
        tok,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=top_k,
        top_p=args.top_p,
        seed=args.seed,
        on_text=show if args.stream else None,
        token_healing=args.token_healing,
    )
    if not args.stream:
        show(args.prompt + result.text)
    show("\n")
    why = "EOS" if result.stopped_at_eos else f"the limit of {args.max_new_tokens} tokens"
    print(
        f"[{result.new_tokens} tokens in {result.seconds:.2f} s, {result.tokens_per_s:.1f} tokens/s; "
        f"stopped at {why}]",
        file=sys.stderr,
    )
    return 0
