"""``python -m mpidp.checkpoint``: what a checkpoint holds, and its model as one plain safetensors file (no MPI)."""

from __future__ import annotations

import argparse
import sys

from safetensors.numpy import save_file

from . import collective, files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpidp.checkpoint", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print what a checkpoint holds")
    info.add_argument("path", help="a checkpoint, or a folder of them (its latest)")
    export = sub.add_parser("export", help="write the model's parameters, whole, into one safetensors file")
    export.add_argument("path", help="a checkpoint, or a folder of them (its latest)")
    export.add_argument("out", help="the safetensors file to write (torch: safetensors.torch.load_file; NumPy: safetensors.numpy.load_file)")
    args = ap.parse_args(argv)
    try:
        path = collective.resolve(args.path)
        if args.command == "info":
            m, _ = files.read_manifest(path)
            optimizer = m["optimizer"]["kind"] if m["optimizer"] else "none"
            print(f"{path}: written by {m['world_size']} ranks (mpidp {m['mpidp']}), window {m['window']}, exact={m['exact']}, id {m['id']}")
            print(f"{len(m['params'])} parameters ({len(m['aliases'])} tied names), optimizer {optimizer}, extras {sorted(m['extras']) + m['extra_arrays']}")
            return 0
        params = collective.consolidate(path)
        save_file({k: v for k, v in params.items()}, args.out, metadata={"format": "pt", "source": str(path)})
        print(f"wrote {len(params)} tensors of {path} to {args.out}")
    except Exception as e:  # noqa: BLE001 - a bad checkpoint is a message and exit 2, never a traceback
        text = str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"
        print(f"python -m mpidp.checkpoint: {text}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
