"""Copy a pyarrow wheel without the parts datasets/TRL never import (bench/trl_wheels.sh): Arrow
Flight, headers, tests. (libarrow_substrait stays: pyarrow.lib links it.)"""
import os
import re
import sys
import zipfile

DROP = re.compile(r"^pyarrow/(libarrow_flight\.|_flight\.|include/|tests/|src/)")
src, out = sys.argv[1], sys.argv[2]
dst = os.path.join(out, os.path.basename(src))
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
    record = next(n for n in zi.namelist() if n.endswith(".dist-info/RECORD"))
    kept = []
    for info in zi.infolist():
        if DROP.match(info.filename) or info.filename == record:
            continue
        zo.writestr(info, zi.read(info.filename))
        kept.append(info.filename)
    zo.writestr(record, "".join(f"{n},,\n" for n in kept + [record]))
print(f"slim {os.path.basename(src)}: {os.path.getsize(src) / 2**20:.1f} -> {os.path.getsize(dst) / 2**20:.1f} MiB")
