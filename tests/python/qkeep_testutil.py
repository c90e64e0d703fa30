"""What the Python tests share: the build tree, its qkeep command, examples and chains."""

import json
import os
import subprocess
import tempfile

BUILD = os.path.abspath(os.environ.get("QKEEP_TEST_BUILDDIR", "."))
SRC = os.path.abspath(os.environ.get("QKEEP_TEST_SRCDIR", "."))
CLI = os.path.join(BUILD, "cli", "qkeep")
EXAMPLES = os.path.join(BUILD, "examples")


def example(name):
    return os.path.join(EXAMPLES, name)


def schemes():
    """Every scheme make wrote an example (and a W1) for: examples/tiny-SCHEME with tiny-w1-SCHEME."""
    out = []
    for d in sorted(os.listdir(EXAMPLES)):
        if d.startswith("tiny-") and not d.startswith("tiny-w1") and os.path.isdir(example("tiny-w1-" + d[5:])):
            out.append(d[5:])
    return out


def plugin_dirs():
    return [d for d in os.environ.get("QKEEP_PLUGIN_PATH", "").split(":") if d] + [
        os.path.join(BUILD, "plugins", "cpu", ".libs")]


def built(backend):
    return any(os.path.exists(os.path.join(d, "backend-%s.so" % backend)) for d in plugin_dirs())


def cpu_chain():
    """The CPU chain of this build, as configure orders it (cpu-zentorch, cpu-onednn, reference)."""
    return ", ".join(b for b in ("cpu-zentorch", "cpu-onednn", "reference") if built(b))


def write_config(directory, chain, extra=""):
    path = os.path.join(directory, "qkeep.ini")
    with open(path, "w") as f:
        f.write("[qkeep]\nbackend = %s\nplugin_dir = %s\n%s" % (chain, ":".join(plugin_dirs()), extra))
    return path


def cli_json(config, *args):
    """`qkeep -c CONFIG --json ARGS` parsed (the oracle for census)."""
    out = subprocess.run([CLI, "-c", config, "--json"] + list(args), check=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE).stdout
    return json.loads(out)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class TempDir:
    def __enter__(self):
        self._t = tempfile.TemporaryDirectory(prefix="qkeep-py-", dir=os.path.join(BUILD, "tests")
                                              if os.access(os.path.join(BUILD, "tests"), os.W_OK) else None)
        return self._t.name

    def __exit__(self, *exc):
        self._t.cleanup()
