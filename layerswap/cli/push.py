"""`layerswap push`: upload an exported merge to the user's own Hugging Face Hub repo (only what changed)."""

from __future__ import annotations

from layerswap.cli.options import Bar


def add_parser(sub) -> None:
    s = sub.add_parser("push", help="upload an exported merge to your own Hugging Face Hub repo (only what changed)")
    s.add_argument("folder", metavar="OUT_DIR", help="a folder `layerswap merge` wrote")
    s.add_argument("repo_id", metavar="REPO_ID", help="owner/name; created if it does not exist")
    s.add_argument("--private", action="store_true", help="create the repo private")
    s.add_argument("--revision", metavar="BRANCH", help="push to this branch (created from the default one)")
    s.add_argument("--overwrite", action="store_true", help="push into a repo that is not a layerswap export")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=run)


def run(args) -> int:
    push_folder(args.folder, args.repo_id, private=args.private, revision=args.revision, overwrite=args.overwrite,
                quiet=args.quiet)
    return 0


def push_folder(folder, repo_id: str, *, private: bool, revision: str | None, overwrite: bool, quiet: bool) -> None:
    from layerswap.merge.publish import push

    bar = Bar(enabled=not quiet)
    r = push(folder, repo_id, token=None, allow_ambient_token=True, private=private, revision=revision,
             overwrite=overwrite, progress=bar)
    bar.done()
    print(f"pushed {folder} to {r.url}: {len(r.uploaded)} files sent ({r.bytes_sent / 1e6:.1f} MB), "
          f"{len(r.unchanged)} unchanged" + (f"; commit {r.commit_url}" if r.commit_url else "; nothing new to commit"))
