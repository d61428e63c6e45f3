"""``selfdraft export``: an adapter in another project's checkpoint layout (with a README of the
vLLM / SGLang commands that serve it), or a folder ready for the Hugging Face hub (adapter files +
model card)."""

from __future__ import annotations

from .common import UsageError, check_input_directory, check_int, check_model, check_output_directory, load_model

DEFAULT_SPECULATIVE_TOKENS = 3
"""Tokens drafted per step in the printed engine commands and the speculators config: vLLM's and
SGLang's own EAGLE examples use 2-3 (a chain; deeper chains rarely pay for their draft steps)."""


def add_parser(commands) -> None:
    from heads.kinds import format_names  # the layouts' names, without torch

    parser = commands.add_parser(
        "export", help="write an adapter in another layout, or a folder ready for the Hugging Face hub",
        description="--format/--out: write the checkpoint layout that FasterDecoding Medusa (medusa), vLLM Medusa "
                    "(medusa-vllm), the EAGLE loaders (eagle, eagle3) or vLLM speculators (speculators, EAGLE-3) "
                    "load, with README.md giving the vLLM / SGLang commands that serve it (also printed); refuses "
                    "when the layout cannot hold the drafter exactly (EAGLE: train with `selfdraft train --kind eagle "
                    "--for vllm` or --for sglang). --hub-dir: copy the adapter and write a model card (README.md) for "
                    "`selfdraft push`.",
    )
    parser.add_argument("--adapter", required=True, help="selfdraft adapter directory")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--format", choices=format_names(), help="external checkpoint layout to write (with --out)")
    mode.add_argument("--hub-dir", help="folder to write for upload: adapter files + README.md model card")
    parser.add_argument("--out", help="output directory of --format")
    parser.add_argument("--model", default=None,
                        help="the target model directory; needed for --format eagle/eagle3/speculators (its config and "
                             "output-head rows go into the checkpoint) and for Medusa adapters that share its head")
    parser.add_argument("--verifier", default=None, metavar="ID",
                        help="hub id of the target as engines should load it: recorded as the verifier in a "
                             "speculators config and used in the printed commands (default: the --model path given, "
                             "else the target the adapter records)")
    parser.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS, metavar="N",
                        help="tokens drafted per step by the engines (speculators config, printed vLLM / SGLang "
                             f"commands; default {DEFAULT_SPECULATIVE_TOKENS})")
    parser.add_argument("--no-fc-bias", action="store_true",
                        help="--format eagle: write fc without its bias, for vLLM's EAGLE-1 model (which drops it); "
                             "refused unless the bias is zero, since dropping it changes predictions")
    parser.add_argument("--repo-id", default=None, help="hub repository id, for the model card's loading snippet")
    parser.add_argument("--license", default="other",
                        help="licence id for the model card (default 'other': that of the target model)")
    parser.add_argument("--license-name", default=None, help="licence name when --license is 'other'")
    parser.add_argument("--license-link", default=None, help="link to the licence text")
    parser.set_defaults(handler=run)


def _options(args, config: dict):
    from heads.interop import target_name
    from heads.kind import ExportOptions

    return ExportOptions(out=args.out, target=target_name(config, args.verifier or args.model),
                         verifier=args.verifier or args.model, num_speculative_tokens=args.num_speculative_tokens,
                         fc_bias=not args.no_fc_bias)


def run(args) -> int:
    from heads.interop import check_export, export_adapter, export_file_names, serving, serving_text
    from heads.kind import ExportOptions
    from ..publish import write_hub_folder

    check_input_directory(args.adapter, "--adapter")
    if args.hub_dir:
        path = write_hub_folder(args.adapter, args.hub_dir, args.repo_id, args.license, args.license_name,
                                args.license_link)
        print(f"wrote {path} (adapter files + README.md); upload it with "
              f"`selfdraft push --hub-dir {path} --repo-id {args.repo_id or 'OWNER/NAME'}`")
        return 0
    if not args.out:
        raise UsageError("--format needs --out DIR")
    check_int(args.num_speculative_tokens, "--num-speculative-tokens", 1, " (tokens drafted per step)")
    if args.model:
        check_model(args.model)
    check_output_directory(args.out, "--out", replaceable=export_file_names())
    # a kind/format mismatch or an option the layout has no use for is refused before any model loads
    config = check_export(args.adapter, args.format, ExportOptions(fc_bias=not args.no_fc_bias))
    options = _options(args, config)
    model = None
    if args.model:
        model, _ = load_model(args.model)
    path = export_adapter(args.adapter, args.format, args.out, model=model, options=options)
    print(f"wrote {args.format} checkpoint to {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")
    print(f"serve it (also in {path / 'README.md'}):")
    print(serving_text(serving(config, args.format, options)))
    return 0
