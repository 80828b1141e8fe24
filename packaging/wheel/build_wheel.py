#!/usr/bin/env python3
"""Builds the ddprun wheel from a built tree, with the Python standard library only.

The wheel carries ddprun, ddprun-rdzvd, ddprun-nccl-id and ddprun-watchdog (the agent's
containment watchdog, a static program) under ddprun/_bin/ and every shared
library they load except glibc's under ddprun/_lib/ (libstdc++, libgcc_s, spdlog, fmt, Boost, and
the OpenSSL 3 that ddprun loads on first use), found with ldd (and ldconfig for OpenSSL) and pointed at with an $ORIGIN RUNPATH (patchelf), so the wheel runs where none of
those are installed. The executables run as their own processes, never inside the interpreter, so
their bundled libstdc++ cannot clash with the one Python may have loaded. What is left is glibc:
the platform tag is manylinux_2_<N>_<arch> for the newest GLIBC_2.<N> symbol version any of the
bundled files needs, which is the honest minimum (PEP 600).

The copyright files of the Debian packages those libraries come from go in the dist-info's
licenses/ (their licenses ask for the notice to travel with the binaries).

Console-script entry points (ddprun, ddprun-rdzvd, ddprun-nccl-id) exec the bundled binary, the
way the cmake and ninja wheels do; `python -m ddprun` is the launcher too.

usage: build_wheel.py --build-dir BUILD --out DIR [--version V]
"""
import argparse
import base64
import csv
import hashlib
import io
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

BINARIES = ("ddprun", "ddprun-rdzvd", "ddprun-nccl-id")
# glibc's own libraries: always taken from the system (manylinux allows only these).
GLIBC_LIBS = re.compile(r"^(libc|libm|libdl|librt|libpthread|libutil|libresolv|libanl|ld-linux[-\w.]*)\.so")
GLIBC_VERSION = re.compile(rb"GLIBC_2\.(\d+)")

LAUNCH_PY = '''"""Console-script entry points: replace this process with the bundled binary."""
import os
import signal
import sys

BIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin")


def _exec(name):
    path = os.path.join(BIN_DIR, name)
    # Python ignores SIGPIPE and SIGXFSZ; exec keeps ignored signals ignored, and ddprun's
    # workers must start with the defaults.
    for sig in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, sig):
            signal.signal(getattr(signal, sig), signal.SIG_DFL)
    try:
        os.execv(path, [sys.argv[0]] + sys.argv[1:])
    except OSError as e:
        sys.stderr.write("%s: cannot run the bundled %s: %s (reinstall the ddprun wheel)\\n" % (name, path, e))
        return 127


def ddprun():
    return _exec("ddprun")


def ddprun_rdzvd():
    return _exec("ddprun-rdzvd")


def ddprun_nccl_id():
    return _exec("ddprun-nccl-id")
'''

INIT_PY = '''"""ddprun: native launcher for distributed training (a drop-in torchrun).

This package only carries the binaries; run them as `ddprun`, `ddprun-rdzvd` and
`ddprun-nccl-id` (or `python -m ddprun`). bin_dir() is where they are.
"""
import os

__version__ = "{version}"


def bin_dir():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin")
'''

MAIN_PY = '''import sys

from ddprun._launch import ddprun

sys.exit(ddprun())
'''


def run(cmd):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True).stdout


def shared_deps(path):
    """Resolved non-glibc shared libraries `path` loads, transitively (ldd lists them all)."""
    deps = {}
    for line in run(["ldd", path]).splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if not m:
            continue
        soname, resolved = m.groups()
        if resolved == "not":
            sys.exit("build_wheel: %s needs %s, which ldd cannot find" % (path, soname))
        if not GLIBC_LIBS.match(soname):
            deps[soname] = resolved
    return deps


def dlopened_deps(path):
    """Libraries `path` loads with dlopen on first use, which ldd cannot see: bin/ddprun loads
    OpenSSL 3 that way (rendezvous/openssl/); bundled like the linked ones."""
    with open(path, "rb") as f:
        data = f.read()
    if b"libssl.so.3\0" not in data:
        return {}
    cache = run(["ldconfig", "-p"])
    deps = {}
    for soname in ("libcrypto.so.3", "libssl.so.3"):
        for m in re.finditer(r"^\s*%s \(([^)]*)\) => (\S+)$" % re.escape(soname), cache, re.M):
            if platform.machine() != "x86_64" or "x86-64" in m.group(1):
                deps[soname] = m.group(2)
                break
        else:
            sys.exit("build_wheel: %s loads %s on demand, which ldconfig cannot find (apt-get install libssl3)"
                     % (path, soname))
    return deps


def license_files(libs):
    """{package: copyright text} for the Debian packages the bundled libraries come from. Their
    licenses ask for the notice to travel with the binaries (OpenSSL's Apache-2.0, fmt's and
    spdlog's MIT, the GCC runtime library exception for libstdc++ and libgcc_s, which bin/ddprun
    also has built in); Debian keeps each package's in /usr/share/doc/<package>/copyright."""
    if shutil.which("dpkg-query") is None:
        sys.exit("build_wheel: dpkg-query is missing: the bundled libraries' license files are taken from "
                 "their Debian packages (/usr/share/doc/<package>/copyright)")
    out = {}
    for soname, resolved in sorted(libs.items()):
        owner = None
        # usrmerge: dpkg may know the file under /lib or /usr/lib.
        for path in dict.fromkeys((resolved, os.path.realpath(resolved), re.sub(r"^/usr/", "/", resolved),
                                   re.sub(r"^/usr/", "/", os.path.realpath(resolved)))):
            r = subprocess.run(["dpkg-query", "-S", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            if r.returncode == 0 and ":" in r.stdout:
                owner = r.stdout.split(":", 1)[0].strip()
                break
        if owner is None:
            sys.exit("build_wheel: no Debian package owns %s (%s): cannot bundle its license" % (resolved, soname))
        name = owner.split(":")[0].split(",")[0].strip()
        copyright_path = "/usr/share/doc/%s/copyright" % name
        if not os.path.isfile(copyright_path):
            sys.exit("build_wheel: %s (package %s, for %s) is missing" % (copyright_path, name, soname))
        with open(copyright_path, "rb") as f:
            out[name] = f.read()
    return out


def sha256_record(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "sha256=" + digest


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--version", help="default: CMAKE_PROJECT_VERSION from the build's CMakeCache.txt")
    args = ap.parse_args()
    for tool in ("ldd", "patchelf", "strip"):
        if shutil.which(tool) is None:
            sys.exit("build_wheel: %s is not installed (apt-get install %s)" %
                     (tool, {"patchelf": "patchelf", "strip": "binutils", "ldd": "libc-bin"}[tool]))

    version = args.version
    if not version:
        cache = open(os.path.join(args.build_dir, "CMakeCache.txt")).read()
        m = re.search(r"^CMAKE_PROJECT_VERSION:STATIC=(\S+)$", cache, re.M)
        if not m:
            sys.exit("build_wheel: no CMAKE_PROJECT_VERSION in %s/CMakeCache.txt" % args.build_dir)
        version = m.group(1)

    with tempfile.TemporaryDirectory(prefix="ddprun-wheel-") as stage:
        bin_out = os.path.join(stage, "_bin")
        lib_out = os.path.join(stage, "_lib")
        os.makedirs(bin_out)
        os.makedirs(lib_out)
        libs = {}
        for name in BINARIES:
            src = os.path.join(args.build_dir, "bin", name)
            if not os.access(src, os.X_OK):
                sys.exit("build_wheel: %s is missing; build first (scripts/build)" % src)
            libs.update(shared_deps(src))
            libs.update(dlopened_deps(src))
            dst = os.path.join(bin_out, name)
            shutil.copy2(src, dst)
            run(["strip", "--strip-unneeded", dst])
            run(["patchelf", "--set-rpath", "$ORIGIN/../_lib", dst])
        # ddprun's containment watchdog: a static program without a C library, copied as it is
        # (built for x86-64 and aarch64 only; elsewhere the agent forks its watchdog).
        src = os.path.join(args.build_dir, "bin", "ddprun-watchdog")
        if os.access(src, os.X_OK):
            dst = os.path.join(bin_out, "ddprun-watchdog")
            shutil.copy2(src, dst)
            run(["strip", dst])
        for soname, resolved in sorted(libs.items()):
            dst = os.path.join(lib_out, soname)
            shutil.copy(os.path.realpath(resolved), dst)
            os.chmod(dst, 0o755)
            run(["strip", "--strip-unneeded", dst])
            run(["patchelf", "--set-rpath", "$ORIGIN", dst])

        # The newest glibc symbol version anything in the wheel needs.
        newest = 0
        for d in (bin_out, lib_out):
            for f in os.listdir(d):
                dyn = run(["readelf", "--dyn-syms", "--wide", "-V", os.path.join(d, f)]).encode()
                newest = max([newest] + [int(v) for v in GLIBC_VERSION.findall(dyn)])
        arch = platform.machine()
        tag = "py3-none-manylinux_2_%d_%s" % (newest, arch)

        files = {
            "ddprun/__init__.py": INIT_PY.format(version=version).encode(),
            "ddprun/__main__.py": MAIN_PY.encode(),
            "ddprun/_launch.py": LAUNCH_PY.encode(),
        }
        modes = {}
        for sub, d in (("_bin", bin_out), ("_lib", lib_out)):
            for f in sorted(os.listdir(d)):
                with open(os.path.join(d, f), "rb") as fh:
                    files["ddprun/%s/%s" % (sub, f)] = fh.read()
                modes["ddprun/%s/%s" % (sub, f)] = 0o755
        dist_info = "ddprun-%s.dist-info" % version
        licenses = license_files(libs)
        for name, text in sorted(licenses.items()):
            files["%s/licenses/%s.copyright" % (dist_info, name)] = text
        files[dist_info + "/METADATA"] = (
            "Metadata-Version: 2.1\n"
            "Name: ddprun\n"
            "Version: %s\n"
            "Summary: Native launcher for distributed training: a drop-in torchrun\n"
            "Requires-Python: >=3.7\n"
            "Classifier: Operating System :: POSIX :: Linux\n"
            "Classifier: Programming Language :: C++\n"
            "\n"
            "ddprun, ddprun-rdzvd and ddprun-nccl-id as console commands of this environment.\n"
            "The binaries bundle their C++ libraries and need glibc 2.%d or newer; the bundled\n"
            "libraries' copyright and license notices are in this distribution's licenses/.\n"
            % (version, newest)).encode()
        files[dist_info + "/WHEEL"] = (
            "Wheel-Version: 1.0\n"
            "Generator: ddprun packaging/wheel/build_wheel.py\n"
            "Root-Is-Purelib: false\n"
            "Tag: %s\n" % tag).encode()
        files[dist_info + "/entry_points.txt"] = (
            "[console_scripts]\n"
            "ddprun = ddprun._launch:ddprun\n"
            "ddprun-rdzvd = ddprun._launch:ddprun_rdzvd\n"
            "ddprun-nccl-id = ddprun._launch:ddprun_nccl_id\n").encode()
        files[dist_info + "/top_level.txt"] = b"ddprun\n"
        record = io.StringIO()
        writer = csv.writer(record, lineterminator="\n")
        for path, data in files.items():
            writer.writerow([path, sha256_record(data), str(len(data))])
        writer.writerow([dist_info + "/RECORD", "", ""])
        files[dist_info + "/RECORD"] = record.getvalue().encode()

        os.makedirs(args.out, exist_ok=True)
        wheel = os.path.join(args.out, "ddprun-%s-%s.whl" % (version, tag))
        tmp = wheel + ".tmp"
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            for path, data in files.items():
                info = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (0o100000 | modes.get(path, 0o644)) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, data)
        os.replace(tmp, wheel)
        print(wheel)
        print("bundled: %s; needs glibc >= 2.%d; licenses of %s" % (", ".join(sorted(libs)), newest,
              ", ".join(sorted(licenses))), file=sys.stderr)


if __name__ == "__main__":
    main()
