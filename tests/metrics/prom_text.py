"""A strict parser of Prometheus' text exposition format (version 0.0.4), independent of the C++
writer: every line must be a HELP line, a TYPE line or a sample; samples must follow their
family's TYPE line, families must not interleave, series must not repeat, and histograms must
have cumulative buckets ending at le="+Inf" with matching _count and a _sum.

parse(text) -> {family_name: {"type": str, "help": str, "samples": [(name, labels_dict, value)]}}
Raises ValueError naming the line on any violation.
"""
import math
import re

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
SAMPLE = re.compile(r"^(" + NAME + r")(\{.*\})? (\S+)( -?[0-9]+)?$")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def parse_value(text, where):
    if text in ("+Inf", "Inf"):
        return math.inf
    if text == "-Inf":
        return -math.inf
    if text == "NaN":
        return math.nan
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        raise ValueError(f"{where}: bad value {text!r}")
    return float(text)


def parse_labels(text, where):
    # text is "{...}" including braces
    body = text[1:-1]
    labels = {}
    i = 0
    while i < len(body):
        m = LABEL_NAME.match(body, i)
        if not m:
            raise ValueError(f"{where}: bad label name at {body[i:]!r}")
        name = m.group(0)
        i = m.end()
        if body[i:i + 2] != '="':
            raise ValueError(f"{where}: expected =\" after label {name}")
        i += 2
        value = []
        while True:
            if i >= len(body):
                raise ValueError(f"{where}: unterminated label value for {name}")
            c = body[i]
            if c == "\\":
                nxt = body[i + 1:i + 2]
                if nxt not in ("\\", '"', "n"):
                    raise ValueError(f"{where}: bad escape \\{nxt} in label {name}")
                value.append("\n" if nxt == "n" else nxt)
                i += 2
            elif c == '"':
                i += 1
                break
            elif c == "\n":
                raise ValueError(f"{where}: raw newline in label {name}")
            else:
                value.append(c)
                i += 1
        if name in labels:
            raise ValueError(f"{where}: label {name} repeated")
        labels[name] = "".join(value)
        if i < len(body):
            if body[i] != ",":
                raise ValueError(f"{where}: expected ',' after label {name}, got {body[i:]!r}")
            i += 1
    return labels


def family_of(name, families):
    if name in families:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if base in families and families[base]["type"] in ("histogram", "summary"):
                return base
    return None


def parse(text):
    if not text.endswith("\n"):
        raise ValueError("exposition does not end with a newline")
    families = {}
    order = []
    seen_series = set()
    current = None
    for n, line in enumerate(text[:-1].split("\n"), 1):
        where = f"line {n} {line!r}"
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE") or not re.fullmatch(NAME, parts[2]):
                raise ValueError(f"{where}: a comment that is neither HELP nor TYPE")
            fam = families.setdefault(parts[2], {"type": None, "help": None, "samples": []})
            if parts[2] not in order:
                order.append(parts[2])
            if fam["samples"]:
                raise ValueError(f"{where}: {parts[1]} after the family's samples")
            key = parts[1].lower()
            if fam[key] is not None:
                raise ValueError(f"{where}: second {parts[1]} line for {parts[2]}")
            if parts[1] == "TYPE":
                if len(parts) != 4 or parts[3] not in TYPES:
                    raise ValueError(f"{where}: bad type")
                fam["type"] = parts[3]
            else:
                fam["help"] = parts[3] if len(parts) == 4 else ""
            current = parts[2]
            continue
        if line == "":
            raise ValueError(f"{where}: empty line")
        m = SAMPLE.match(line)
        if not m:
            raise ValueError(f"{where}: not a sample line")
        name, label_text, value_text = m.group(1), m.group(2), m.group(3)
        labels = parse_labels(label_text, where) if label_text else {}
        value = parse_value(value_text, where)
        fam_name = family_of(name, families)
        if fam_name is None or families[fam_name]["type"] is None:
            raise ValueError(f"{where}: sample before its TYPE line")
        if fam_name != current:
            raise ValueError(f"{where}: family {fam_name} interleaved with {current}")
        series = (name, tuple(sorted(labels.items())))
        if series in seen_series:
            raise ValueError(f"{where}: series repeated")
        seen_series.add(series)
        fam = families[fam_name]
        if fam["type"] == "counter" and not (value >= 0):
            raise ValueError(f"{where}: negative counter")
        if fam["type"] == "histogram" and name == fam_name:
            raise ValueError(f"{where}: histogram sample without _bucket/_sum/_count")
        fam["samples"].append((name, labels, value))
    for fam_name, fam in families.items():
        if fam["type"] is None or fam["help"] is None:
            raise ValueError(f"family {fam_name}: missing TYPE or HELP")
        if fam["type"] == "histogram":
            check_histogram(fam_name, fam["samples"])
    return families


def check_histogram(name, samples):
    groups = {}
    for sname, labels, value in samples:
        rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        g = groups.setdefault(rest, {"buckets": [], "sum": None, "count": None})
        if sname == name + "_bucket":
            if "le" not in labels:
                raise ValueError(f"{name}: bucket without le")
            g["buckets"].append((parse_value(labels["le"], name), value))
        elif sname == name + "_sum":
            g["sum"] = value
        elif sname == name + "_count":
            g["count"] = value
    if not groups:
        raise ValueError(f"{name}: histogram without samples")
    for rest, g in groups.items():
        b = g["buckets"]
        if not b or b[-1][0] != math.inf:
            raise ValueError(f"{name}{rest}: buckets do not end at le=+Inf")
        for (le1, c1), (le2, c2) in zip(b, b[1:]):
            if not le1 < le2:
                raise ValueError(f"{name}{rest}: le not ascending ({le1}, {le2})")
            if c2 < c1:
                raise ValueError(f"{name}{rest}: buckets not cumulative")
        if g["sum"] is None or g["count"] is None:
            raise ValueError(f"{name}{rest}: missing _sum or _count")
        if g["count"] != b[-1][1]:
            raise ValueError(f"{name}{rest}: _count {g['count']} != +Inf bucket {b[-1][1]}")


def value(families, name, **labels):
    """The value of one series: family name (or _count/_sum of a histogram) and exact labels."""
    fam = family_of(name, families)
    assert fam is not None, f"no family for {name}"
    for sname, slabels, v in families[fam]["samples"]:
        if sname == name and slabels == labels:
            return v
    raise AssertionError(f"no series {name}{labels}")


def self_test():
    good = ('# HELP a_total x\n# TYPE a_total counter\na_total{k="v\\"q\\\\\\n"} 3\n'
            '# HELP h y\n# TYPE h histogram\nh_bucket{le="1"} 1\nh_bucket{le="+Inf"} 2\nh_sum 3.5\nh_count 2\n')
    f = parse(good)
    assert value(f, "a_total", k='v"q\\\n') == 3
    bad = [
        "a 1\n",                                                              # no TYPE
        "# TYPE a gauge\n# HELP a x\na 1",                                    # no final newline
        "# HELP a x\n# TYPE a gauge\na{k=\"v} 1\n",                          # unterminated
        "# HELP a x\n# TYPE a gauge\na 1\na 2\n",                             # repeated series
        "# HELP a x\n# TYPE a gauge\na one\n",                                # bad value
        "# HELP h y\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
        "# HELP h y\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
        "# HELP a x\n# TYPE a gauge\n# HELP b x\n# TYPE b gauge\nb 1\na 1\n",  # interleaved
        "# HELP a x\n# TYPE a counter\na -1\n",
        "# just a comment\n",
    ]
    for text in bad:
        try:
            parse(text)
        except ValueError:
            continue
        raise AssertionError(f"parser accepted {text!r}")
