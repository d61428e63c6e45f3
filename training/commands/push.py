"""``selfdraft push``: upload a folder written by ``selfdraft export --hub-dir`` to the hub."""

from __future__ import annotations


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "push", help="upload a folder written by `selfdraft export --hub-dir` to the Hugging Face hub",
        description="Create the model repository when missing and upload the folder with huggingface_hub. Needs a "
                    "token (`hf auth login` or HF_TOKEN) and a network; says which is missing otherwise.",
    )
    parser.add_argument("--hub-dir", required=True, help="folder written by `selfdraft export --hub-dir`")
    parser.add_argument("--repo-id", required=True, help="model repository, OWNER/NAME")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--message", default="Upload selfdraft adapter", help="commit message")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from ..publish import PublishError, push_folder
    from .common import check_input_directory

    check_input_directory(args.hub_dir, "--hub-dir")
    try:
        url = push_folder(args.hub_dir, args.repo_id, private=args.private, commit_message=args.message)
    except PublishError as error:
        raise SystemExit(f"selfdraft push: {error}") from None
    print(f"uploaded {args.hub_dir} to {args.repo_id}: {url}")
    return 0
