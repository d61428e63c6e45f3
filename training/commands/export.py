"""``selfdraft export``: an adapter in another project's checkpoint layout, or a folder ready for the
Hugging Face hub (adapter files + model card)."""

from __future__ import annotations

from heads import kinds
from heads.interop import SIDECAR_NAME

from .common import UsageError, check_input_directory, check_output_directory, load_model


def add_parser(commands) -> None:
    from heads.interop import format_names

    parser = commands.add_parser(
        "export", help="write an adapter in another layout, or a folder ready for the Hugging Face hub",
        description="--format/--out: write the checkpoint layout that FasterDecoding Medusa (medusa), vLLM Medusa "
                    "(medusa-vllm), the EAGLE loaders (eagle, eagle3) or vLLM speculators (speculators, EAGLE-3) "
                    "load; refuses when the layout cannot hold the drafter exactly (EAGLE: train with --eagle-layout "
                    "eagle1/eagle3). --hub-dir: copy the adapter and write a model card (README.md) for "
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
    parser.add_argument("--repo-id", default=None, help="hub repository id, for the model card's loading snippet")
    parser.add_argument("--license", default="other",
                        help="licence id for the model card (default 'other': that of the target model)")
    parser.add_argument("--license-name", default=None, help="licence name when --license is 'other'")
    parser.add_argument("--license-link", default=None, help="link to the licence text")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from heads.interop import export_adapter
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
    check_output_directory(args.out, "--out", replaceable=tuple(
        {name for _, fmt in kinds.formats().values() for name in fmt.files} | {SIDECAR_NAME}))
    model = None
    if args.model:
        model, _ = load_model(args.model)
    path = export_adapter(args.adapter, args.format, args.out, model=model)
    print(f"wrote {args.format} checkpoint to {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")
    return 0
