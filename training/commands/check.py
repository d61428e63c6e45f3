"""``selfdraft check``: re-measure an adapter on a (possibly updated) target, for CI."""

from __future__ import annotations

from pathlib import Path

from .common import (
    add_paragraphs_argument, check_input_directory, check_int, check_model, check_output_file, load_model, read_prompts,
    require, write_json,
)

DEFAULT_CHECK_PROMPTS = 8
DEFAULT_CHECK_TOKENS = 64


def recorded_acceptance(acceptance: dict, data_path: str) -> tuple[str, dict] | None:
    """The greedy entry recorded for the data file's stem, else the first greedy entry (None: none)."""
    from heads.adapter import acceptance_entries

    greedy = [(mix, entry) for mix, entry in acceptance_entries(acceptance) if not entry.get("temperature")]
    for mix, entry in greedy:
        if mix == Path(data_path).stem:
            return mix, entry
    return greedy[0] if greedy else None


def split_label(entry: dict) -> str:
    """How the recorded tau was measured, for the report: ``" (held-out prompts)"``, ``" (in-sample:
    training prompts)"``, ``" (--eval-data prompts)"``, ``" (traffic served while learning online)"``
    (:mod:`training.online`); adapters written before the label: nothing."""
    labels = {"held-out": "held-out prompts", "in-sample": "in-sample: training prompts",
              "eval-data": "--eval-data prompts", "served": "traffic served while learning online"}
    split = entry.get("split")
    return f" ({labels.get(split, split)})" if split else ""


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "check", help="re-measure an adapter on a (possibly updated) target",
        description="Load the adapter on the model even when its fingerprint differs (with a warning), re-measure "
                    "tau and tokens/s on the given prompts, print them beside the figures recorded at save time "
                    "and exit 1 when tau fell by more than --threshold (relative) or outputs differ from plain "
                    "greedy generation; exit 2 when the adapter records no greedy acceptance to compare with.",
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model directory (or hub id)")
    parser.add_argument("--adapter", required=True, help="adapter directory (selfdraft or an imported format)")
    parser.add_argument("--data", required=True, help="prompts (jsonl or plain text); the recorded entry named "
                                                      "after the file's stem is compared, else the first")
    parser.add_argument("--threshold", type=float, default=0.1,
                        help="largest allowed relative drop of tau (default 0.1: 10%%)")
    parser.add_argument("--prompts", type=int, default=None,
                        help=f"prompts to measure (default: as many as recorded, else {DEFAULT_CHECK_PROMPTS})")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"tokens per prompt (default: as recorded, else {DEFAULT_CHECK_TOKENS})")
    parser.add_argument("--json", default=None, help="write the comparison to this JSON file")
    add_paragraphs_argument(parser)
    parser.set_defaults(handler=run)


def _check_rows(recorded: dict | None, report, target_line: str, drop: float | None, threshold: float) -> list:
    def figure(entry, key, spec="{:.2f}"):
        return spec.format(entry[key]) if entry and key in entry else "-"
    from tree_attention.decode import DecodeStats

    from .bench import format_rates

    now = report.to_dict()
    survival = (recorded or {}).get("acceptance_by_position", [])  # adapters before prefix_survival: the same list
    return [
        ("", "recorded", "now"),
        ("tau", figure(recorded, "tau"), figure(now, "tau")),
        ("tokens/s speculative", figure(recorded, "tokens_per_s_spec", "{:.1f}"),
         figure(now, "tokens_per_s_spec", "{:.1f}")),
        ("tokens/s plain", figure(recorded, "tokens_per_s_plain", "{:.1f}"),
         figure(now, "tokens_per_s_plain", "{:.1f}")),
        ("prefix survival P(>=k)", format_rates(survival), format_rates(report.prefix_survival)),
        ("conditional P(k | k-1)", format_rates(DecodeStats.conditional_rates(survival)),
         format_rates(report.conditional_acceptance)),
        ("identical to generate", "", str(report.identical)),
        ("target fingerprint", "", target_line),
        ("tau change", "", "-" if drop is None else f"{-drop:+.1%} (allowed: -{threshold:.0%})"),
    ]


def run(args) -> int:
    import heads
    from ..evaluate import encode_prompts, measure

    require(0 <= args.threshold < 1, f"--threshold must lie in [0, 1); got {args.threshold}")
    check_int(args.prompts, "--prompts", 1)
    check_int(args.max_new_tokens, "--max-new-tokens", 1)
    check_model(args.model)
    check_input_directory(args.adapter, "--adapter")
    read_prompts(args.data, None, paragraphs=args.paragraphs)
    check_output_file(args.json, "--json")
    model, tokenizer = load_model(args.model)
    spec = heads.load_heads(model, args.adapter, strict=False)  # a changed target warns, still loads
    pin = heads.TargetPin(spec.metadata["target"])
    differences = pin.differences(heads.TargetPin.of(model))
    recorded = recorded_acceptance(spec.metadata.get("acceptance", {}), args.data)
    mix, entry = recorded if recorded else (None, None)
    count = args.prompts or (entry or {}).get("prompts") or DEFAULT_CHECK_PROMPTS
    tokens = args.max_new_tokens or (entry or {}).get("max_new_tokens") or DEFAULT_CHECK_TOKENS
    prompts = encode_prompts(tokenizer, read_prompts(args.data, tokenizer, paragraphs=args.paragraphs), count)
    require(bool(prompts), f"--data {args.data}: no usable prompts")
    report = measure(spec, prompts, tokens)
    drop = (entry["tau"] - report.tau) / entry["tau"] if entry and entry["tau"] > 0 else None
    target_line = ("not recorded (imported checkpoint)" if not pin.verifiable and not differences
                   else "matches" if not differences else "differs: " + "; ".join(differences))
    print(f"adapter {args.adapter} on {args.model}; recorded figures: "
          f"{repr(mix) + ' mix' + split_label(entry) if mix else 'none'}; measured on {len(prompts)} prompts x "
          f"{tokens} tokens")
    for name, before, after in _check_rows(entry, report, target_line, drop, args.threshold):
        print(f"{name:<24} {before:<28} {after}")
    passed = drop is not None and drop <= args.threshold and report.identical
    write_json(args.json, {
        "adapter": str(args.adapter), "model": str(args.model), "data": str(args.data), "mix": mix,
        "recorded": entry, "measured": report.to_dict(), "tau_drop": drop, "threshold": args.threshold,
        "target_matches": not differences, "target_differences": differences, "passed": passed,
    })
    if entry is None:
        print("no greedy acceptance recorded in the adapter config: nothing to compare with")
        return 2
    print("PASS" if passed else "FAIL: " + ("outputs differ from plain greedy generation" if not report.identical
                                           else f"tau fell by {drop:.1%} (more than {args.threshold:.0%})"))
    return 0 if passed else 1
