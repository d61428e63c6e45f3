"""``selfdraft corpus``: a lookup corpus of the target's own continuations of your prompts."""

from __future__ import annotations

from .common import add_paragraphs_argument, check_int, check_model, check_output_file, load_model, read_prompts


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "corpus", help="write the target's own continuations of your prompts, a corpus for lookup drafting",
        description="Generate the target's greedy continuation of each prompt (exactly model.generate's, sped up "
                    "by lookup over the corpus written so far) and write prompt + continuation as jsonl "
                    "{\"text\": ...} records, for `selfdraft bench --lookup-corpus` or attach_heads(..., corpus=).",
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model directory (or hub id)")
    parser.add_argument("--data", required=True, help="prompts like the traffic to serve (jsonl or plain text)")
    parser.add_argument("--out", required=True, help="jsonl file to write")
    parser.add_argument("--prompts", type=int, default=None, help="use at most this many prompts (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    add_paragraphs_argument(parser)
    parser.set_defaults(handler=run)


def run(args) -> int:
    import torch

    from ..corpus import target_corpus, write_corpus
    from ..evaluate import encode_prompts

    check_int(args.max_new_tokens, "--max-new-tokens", 1)
    if args.prompts is not None:
        check_int(args.prompts, "--prompts", 1)
    check_int(args.threads, "--threads", 1)
    check_model(args.model)
    read_prompts(args.data, None, paragraphs=args.paragraphs)
    check_output_file(args.out, "--out")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    prompts = encode_prompts(tokenizer, read_prompts(args.data, tokenizer, paragraphs=args.paragraphs), args.prompts)
    sequences, facts = target_corpus(model, prompts, args.max_new_tokens)
    texts = [tokenizer.decode(sequence, skip_special_tokens=True) for sequence in sequences]
    path = write_corpus(args.out, texts)
    print(f"wrote {facts['prompts']} texts ({facts['new_tokens']} generated tokens, {facts['seconds']:.1f} s) "
          f"to {path}")
    return 0
