"""The adapter subcommands of ``selfdraft``: ``check`` (re-measure an adapter on a possibly
updated target, for CI), ``export`` (other checkpoint layouts, or a hub folder with a model card)
and ``push`` (upload a hub folder)."""

from __future__ import annotations

import argparse
from pathlib import Path

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


def add_check_parser(commands) -> None:
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
    parser.set_defaults(handler=run_check)


def _check_rows(recorded: dict | None, report, target_line: str, drop: float | None, threshold: float) -> list:
    def figure(entry, key, spec="{:.2f}"):
        return spec.format(entry[key]) if entry and key in entry else "-"
    now = report.to_dict()
    rates = " ".join(f"{rate:.2f}" for rate in report.acceptance_by_position)
    recorded_rates = " ".join(f"{rate:.2f}" for rate in (recorded or {}).get("acceptance_by_position", [])) or "-"
    return [
        ("", "recorded", "now"),
        ("tau", figure(recorded, "tau"), figure(now, "tau")),
        ("tokens/s speculative", figure(recorded, "tokens_per_s_spec", "{:.1f}"),
         figure(now, "tokens_per_s_spec", "{:.1f}")),
        ("tokens/s plain", figure(recorded, "tokens_per_s_plain", "{:.1f}"),
         figure(now, "tokens_per_s_plain", "{:.1f}")),
        ("acceptance by position", recorded_rates, rates or "-"),
        ("identical to generate", "", str(report.identical)),
        ("target fingerprint", "", target_line),
        ("tau change", "", "-" if drop is None else f"{-drop:+.1%} (allowed: -{threshold:.0%})"),
    ]


def run_check(args) -> int:
    import heads
    from heads.adapter import target_differences
    from heads.backbone import target_fingerprint
    from .cli import _load_model, _write_json
    from .data import load_prompts
    from .evaluate import encode_prompts, measure

    if not 0 <= args.threshold < 1:
        raise SystemExit(f"selfdraft check: --threshold must lie in [0, 1); got {args.threshold}")
    model, tokenizer = _load_model(args.model)
    try:
        spec = heads.load_heads(model, args.adapter, strict=False)  # a changed target warns, still loads
    except heads.AdapterError as error:
        raise SystemExit(f"selfdraft check: {error}") from None
    differences = target_differences(spec.metadata["target"], target_fingerprint(model))
    recorded = recorded_acceptance(spec.metadata.get("acceptance", {}), args.data)
    mix, entry = recorded if recorded else (None, None)
    count = args.prompts or (entry or {}).get("prompts") or DEFAULT_CHECK_PROMPTS
    tokens = args.max_new_tokens or (entry or {}).get("max_new_tokens") or DEFAULT_CHECK_TOKENS
    prompts = encode_prompts(tokenizer, load_prompts(args.data, tokenizer), count)
    if not prompts:
        raise SystemExit(f"selfdraft check: no usable prompts in {args.data}")
    report = measure(spec, prompts, tokens)
    drop = (entry["tau"] - report.tau) / entry["tau"] if entry and entry["tau"] > 0 else None
    unverified = spec.metadata["target"].get("weights_sha256") is None
    target_line = ("not recorded (imported checkpoint)" if unverified and not differences
                   else "matches" if not differences else "differs: " + "; ".join(differences))
    print(f"adapter {args.adapter} on {args.model}; recorded figures: "
          f"{repr(mix) + ' mix' if mix else 'none'}; measured on {len(prompts)} prompts x {tokens} tokens")
    for name, before, after in _check_rows(entry, report, target_line, drop, args.threshold):
        print(f"{name:<24} {before:<28} {after}")
    passed = drop is not None and drop <= args.threshold and report.identical
    _write_json(args.json, {
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


def add_export_parser(commands) -> None:
    from heads.interop import format_names

    parser = commands.add_parser(
        "export", help="write an adapter in another layout, or a folder ready for the Hugging Face hub",
        description="--format/--out: write the checkpoint layout that FasterDecoding Medusa (medusa), vLLM Medusa "
                    "(medusa-vllm) or the EAGLE loaders (eagle, eagle3) load; refuses when the layout cannot hold "
                    "the drafter exactly (EAGLE: train with --eagle-layout eagle1/eagle3). --hub-dir: copy the adapter and write a model card (README.md) for "
                    "`selfdraft push`.",
    )
    parser.add_argument("--adapter", required=True, help="selfdraft adapter directory")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--format", choices=format_names(), help="external checkpoint layout to write (with --out)")
    mode.add_argument("--hub-dir", help="folder to write for upload: adapter files + README.md model card")
    parser.add_argument("--out", help="output directory of --format")
    parser.add_argument("--model", default=None,
                        help="the target model directory; needed for --format eagle/eagle3 (its config and "
                             "output-head rows go into the checkpoint) and for Medusa adapters that share its head")
    parser.add_argument("--repo-id", default=None, help="hub repository id, for the model card's loading snippet")
    parser.add_argument("--license", default="other",
                        help="licence id for the model card (default 'other': that of the target model)")
    parser.add_argument("--license-name", default=None, help="licence name when --license is 'other'")
    parser.add_argument("--license-link", default=None, help="link to the licence text")
    parser.set_defaults(handler=run_export)


def run_export(args) -> int:
    from heads.adapter import AdapterError
    from heads.interop import export_adapter
    from .publish import write_hub_folder

    if args.hub_dir:
        try:
            path = write_hub_folder(args.adapter, args.hub_dir, args.repo_id, args.license, args.license_name,
                                    args.license_link)
        except AdapterError as error:
            raise SystemExit(f"selfdraft export: {error}") from None
        print(f"wrote {path} (adapter files + README.md); upload it with "
              f"`selfdraft push --hub-dir {path} --repo-id {args.repo_id or 'OWNER/NAME'}`")
        return 0
    if not args.out:
        raise SystemExit("selfdraft export: --format needs --out DIR")
    model = None
    if args.model:
        from .cli import _load_model
        model, _ = _load_model(args.model)
    try:
        path = export_adapter(args.adapter, args.format, args.out, model=model)
    except AdapterError as error:
        raise SystemExit(f"selfdraft export: {error}") from None
    print(f"wrote {args.format} checkpoint to {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")
    return 0


def add_push_parser(commands) -> None:
    parser = commands.add_parser(
        "push", help="upload a folder written by `selfdraft export --hub-dir` to the Hugging Face hub",
        description="Create the model repository when missing and upload the folder with huggingface_hub. Needs a "
                    "token (`hf auth login` or HF_TOKEN) and a network; says which is missing otherwise.",
    )
    parser.add_argument("--hub-dir", required=True, help="folder written by `selfdraft export --hub-dir`")
    parser.add_argument("--repo-id", required=True, help="model repository, OWNER/NAME")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--message", default="Upload selfdraft adapter", help="commit message")
    parser.set_defaults(handler=run_push)


def run_push(args) -> int:
    from .publish import PublishError, push_folder

    try:
        url = push_folder(args.hub_dir, args.repo_id, private=args.private, commit_message=args.message)
    except PublishError as error:
        raise SystemExit(f"selfdraft push: {error}") from None
    print(f"uploaded {args.hub_dir} to {args.repo_id}: {url}")
    return 0


def add_adapter_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``check``, ``export`` and ``push``."""
    add_check_parser(commands)
    add_export_parser(commands)
    add_push_parser(commands)
