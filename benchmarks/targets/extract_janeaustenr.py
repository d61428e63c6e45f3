#!/usr/bin/env python3
"""Extract Jane Austen's six novels from the Debian package ``r-cran-janeaustenr``.

The package (Debian 12 "bookworm", version 1.0.0-1, MIT licence for the package;
the novels themselves are public domain, taken from Project Gutenberg) stores
each novel as an R character vector (one element per line of the Gutenberg
text) in the lazy-load database ``data/Rdata.rdb`` / ``data/Rdata.rdx``.  This
script reads that database with a minimal pure-Python R unserializer (only the
handful of SEXP types these objects use) and writes one UTF-8 ``.txt`` file per
novel, so R itself is not needed.

Obtain the package without installing it::

    mkdir -p /tmp/corpora && cd /tmp/corpora
    apt-get download r-cran-janeaustenr
    dpkg -x r-cran-janeaustenr_*_all.deb janeaustenr-deb
    python benchmarks/targets/extract_janeaustenr.py \\
        --pkg-root /tmp/corpora/janeaustenr-deb --out /tmp/corpora/janeaustenr-txt
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import lzma
import os
import struct
import sys
import zlib

DATA_SUBDIR = os.path.join("usr", "lib", "R", "site-library", "janeaustenr", "data")

# R SEXP type codes we need.
NILVALUE_SXP = 254
LISTSXP = 2
CHARSXP = 9
LGLSXP = 10
INTSXP = 13
REALSXP = 14
STRSXP = 16
VECSXP = 19
SYMSXP = 1
REFSXP = 255


class _Reader:
    """Minimal reader for R's XDR serialization format (version 2 or 3)."""

    def __init__(self, data: bytes):
        self.d = data
        self.p = 0
        self.refs: list = []
        if self.d[:2] != b"X\n":
            raise ValueError("only XDR ('X\\n') serialization is supported")
        self.p = 2
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.p += n  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported serialization version {version}")

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.d, self.p)
        self.p += 4
        return v

    def item(self):
        flags = self.int()
        typ = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if typ == NILVALUE_SXP:
            return None
        if typ == REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if typ == SYMSXP:
            name = self.item()  # a CHARSXP
            self.refs.append(name)
            return name
        if typ == CHARSXP:
            n = self.int()
            if n == -1:
                return None
            s = self.d[self.p : self.p + n]
            self.p += n
            return s.decode("utf-8", errors="replace")
        if typ == LISTSXP:
            out = []
            while True:
                attr = self.item() if has_attr else None
                tag = self.item() if has_tag else None
                out.append((tag, self.item()))
                nxt = self.int()
                ntyp = nxt & 0xFF
                if ntyp == NILVALUE_SXP:
                    break
                if ntyp != LISTSXP:
                    raise ValueError("unexpected pairlist continuation")
                has_attr = bool(nxt & (1 << 9))
                has_tag = bool(nxt & (1 << 10))
            del attr  # pairlist attributes are not needed here
            return dict(out)
        if typ in (LGLSXP, INTSXP):
            n = self.int()
            vals = list(struct.unpack_from(f">{n}i", self.d, self.p))
            self.p += 4 * n
        elif typ == REALSXP:
            n = self.int()
            vals = list(struct.unpack_from(f">{n}d", self.d, self.p))
            self.p += 8 * n
        elif typ == STRSXP:
            n = self.int()
            vals = [self.item() for _ in range(n)]
        elif typ == VECSXP:
            n = self.int()
            vals = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported SEXP type {typ}")
        attrs = self.item() if has_attr else None
        if attrs and "names" in attrs and typ == VECSXP:
            return dict(zip(attrs["names"], vals))
        return vals


def _decompress_blob(blob: bytes, compressed) -> bytes:
    if not compressed:
        return blob
    (n,) = struct.unpack(">I", blob[:4])
    kind = compressed if isinstance(compressed, int) else 1
    if kind in (2, 3):  # type byte follows the length: 'Z' zlib, '2' bzip2, 'X' xz, '0' none
        t, body = blob[4:5], blob[5:]
        out = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": bytes}[t](body)
    else:
        out = zlib.decompress(blob[4:])
    if len(out) != n:
        raise ValueError("decompressed length mismatch")
    return out


def read_lazyload_db(base: str) -> dict:
    """Return {name: R object} for an R lazy-load database (base.rdx / base.rdb)."""
    index = _Reader(gzip.decompress(open(base + ".rdx", "rb").read())).item()
    compressed = index.get("compressed")
    if isinstance(compressed, list):
        compressed = compressed[0]
    db = open(base + ".rdb", "rb").read()
    out = {}
    for name, (off, length) in index["variables"].items():
        blob = db[int(off) : int(off) + int(length)]
        out[name] = _Reader(_decompress_blob(blob, compressed)).item()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pkg-root", default="/tmp/corpora/janeaustenr-deb",
                    help="directory where the .deb was unpacked with dpkg -x (or the R package's data/ dir)")
    ap.add_argument("--out", default="/tmp/corpora/janeaustenr-txt")
    args = ap.parse_args(argv)
    data_dir = os.path.join(args.pkg_root, DATA_SUBDIR)
    if not os.path.isdir(data_dir):
        data_dir = args.pkg_root
    objs = read_lazyload_db(os.path.join(data_dir, "Rdata"))
    os.makedirs(args.out, exist_ok=True)
    for name in sorted(objs):
        lines = objs[name]
        if not isinstance(lines, list) or not all(isinstance(x, (str, type(None))) for x in lines):
            continue
        text = "\n".join(x or "" for x in lines).strip() + "\n"
        path = os.path.join(args.out, name + ".txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"{path}: {len(lines)} lines, {len(text.encode('utf-8'))} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
