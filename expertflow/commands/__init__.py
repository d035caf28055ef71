"""Sub-commands of the `expertflow` command line, one module each; each exposes `register(subparsers)`.

Shared here: the checks every command makes on its arguments before doing any work, so that a bad flag fails at once
with the flag's name instead of after a long run or deep inside a library.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import shutil
import sys
import tempfile

__all__ = ["check_output_file", "check_positive", "check_threads", "check_plot_file", "check_fraction", "check_exists",
           "check_tokenizer", "import_plugins", "batch_sizes", "comma_separated", "joined", "note_shadowed_model"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_output_file(path: str, flag: str = "--out", example: str = "out.safetensors",
                      inputs: tuple[str, ...] = ()) -> None:
    """`path` can be written as a file: not a directory, not one of the command's `inputs`, and its directory exists
    and takes a new file (tried, so that a read-only place fails now rather than after the work)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name such as {os.path.join(path, example)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist; create it first")
    for given in inputs:
        if os.path.exists(given) and os.path.exists(path) and os.path.samefile(given, path):
            raise ValueError(f"{flag} {path} is the input {given}; write the result to another file")
    name = os.path.basename(path)
    try:  # a file as long-named as the one a save stages (".NAME.partial"), never the name itself: touched, another
        # run's finished file under it could be removed, and a folder watcher would see an empty file
        tempfile.NamedTemporaryFile(dir=parent, prefix=f".{'x' * len(name)}.").close()  # named: its length counts
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise ValueError(f"{flag} {path}: the name is too long for the file system ({exc.strerror}); give a "
                             "shorter name") from None
        raise ValueError(f"{flag} {path}: cannot write in {parent} ({exc.strerror or exc}); give a writable "
                         "place") from None


def check_positive(value: float | int | None, flag: str, integer: bool = False, zero: bool = False) -> None:
    """`value` (if given) is a finite number above 0 (at least 1 for an `integer`; at least 0 with `zero`)."""
    if value is None:
        return
    # an int is finite; math.isfinite would turn it into a float, which overflows beyond about 1e308
    finite = isinstance(value, int) or math.isfinite(value)
    if not (finite and (value >= 0 if zero else value > 0)):
        need = "at least 0" if zero else ("at least 1" if integer else "above 0")
        if not finite:  # inf is above 0: say what is wrong with it
            need = "a finite number " + (need if need == "above 0" else f"of {need}")
        raise ValueError(f"{flag} {value} must be {need}")


def check_plot_file(path: str, flag: str = "--plot", inputs: tuple[str, ...] = ()) -> str:
    """The image file a plot goes to: `path`, with ".png" added when it has no extension (as matplotlib would),
    checked to be writable, not one of `inputs`, and in a format matplotlib knows."""
    from matplotlib import rcParams
    from matplotlib.figure import Figure

    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    formats = Figure().canvas.get_supported_filetypes()
    if suffix == "pgf" and not shutil.which(rcParams["pgf.texsystem"]):  # matplotlib runs it to write one
        raise ValueError(f"{flag} {path}: .pgf is written with {rcParams['pgf.texsystem']} (TeX), which is not "
                         "installed; give a .png, .svg or .pdf file")
    if suffix and suffix not in formats:
        raise ValueError(f"{flag} {path}: name the image file with an extension matplotlib can write, such as .png, "
                         f".svg or .pdf (known: {', '.join(sorted(formats))})")
    if not suffix and not os.path.isdir(path):
        path += ".png"
    check_output_file(path, flag, example="plot.png", inputs=inputs)
    # Written in place, not replaced: a read-only file fails now (opened to append, nothing written, so its content
    # and time stay); a pipe or device is left alone (opening one would end its reader's input); a link to nothing
    # is written through, into a folder that must exist
    if os.path.isfile(path):
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot write it ({exc.strerror or exc}); give a writable file") \
                from None
    elif os.path.islink(path) and not os.path.exists(path):
        target = os.path.join(os.path.dirname(path), os.readlink(path))
        if not os.path.isdir(os.path.dirname(os.path.abspath(target))):
            raise ValueError(f"{flag} {path}: it links to {target}, in a folder that does not exist; give a writable "
                             "file")
    return path


def check_threads(value: int | None, flag: str = "--threads") -> None:
    """`value` (if given) is a thread count torch can start: at least 1, at most 1024 or 8 per core if more (far
    more ends in a thread-creation failure or a crash inside the OpenMP runtime, with no message). A count above the
    cores runs, only slower: a run made elsewhere with more threads can be repeated here."""
    check_positive(value, flag, integer=True)
    most = max(1024, 8 * (os.cpu_count() or 1))
    if value is not None and value > most:
        raise ValueError(f"{flag} {value} is more than torch can be sure to start ({most}); this machine has "
                         f"{os.cpu_count() or 1} cores")


def check_fraction(value: float, flag: str) -> None:
    """`value` is a share of the experts cached, in (0, 1]."""
    if not 0 < value <= 1:
        raise ValueError(f"{flag} {value} must be in (0, 1] (the share of the experts cached)")


def check_exists(flag: str, path: str | None) -> None:
    """`path` (if given) exists."""
    if path and not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file or directory")


def check_tokenizer(flag: str, model_dir: str) -> None:
    """`model_dir` is a directory with the tokenizer saved beside the model."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"{flag} {model_dir}: no such directory; give a saved Hugging Face MoE model directory")
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{flag} {model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
                         "tokenizer beside the model with tokenizer.save_pretrained(DIR)")


def note_shadowed_model(command: str, model: str | None) -> None:
    """`--model tiny-moe` names the built-in model even where a directory of that name sits in the working directory:
    a note on stderr says which runs, and how to give the directory."""
    from expertflow.models import TINY_MOE_NAME, is_tiny_moe

    if model == TINY_MOE_NAME and os.path.isdir(model) and not is_tiny_moe(model):
        print(f"expertflow {command}: note: --model {model} names the built-in model; the directory {model} here is "
              f"not used (give ./{model} for it)", file=sys.stderr)


def import_plugins(plugins: list[str] | None, flag: str = "--plugin") -> None:
    """Import each plug-in: a `.py` file, or a module name found from the working directory (policies it registers
    with `@register_policy` become usable by name). ValueError naming the flag when one cannot be imported."""
    import importlib
    import importlib.util
    import zlib

    for plugin in plugins or ():
        if plugin.endswith(".py") and not os.path.isfile(plugin):
            raise ValueError(f"{flag} {plugin}: no such file")
        # A file imports its neighbours; a module name is looked up from the working directory (which the console
        # script does not search by itself).
        where = os.path.dirname(os.path.abspath(plugin)) if plugin.endswith(".py") else os.getcwd()
        if where not in sys.path:
            sys.path.insert(0, where)
        name = plugin
        try:
            if plugin.endswith(".py"):  # under a name of its own: two files called policies.py are two modules
                path = os.path.abspath(plugin)
                name = f"expertflow_plugin_{zlib.crc32(path.encode()):08x}_{os.path.basename(path)[:-3]}"
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(plugin)
        except Exception as exc:  # a syntax error or a failing import inside the plug-in too
            sys.modules.pop(name, None)
            raise ValueError(f"{flag} {plugin}: cannot import it ({type(exc).__name__}: {exc})") from None


def comma_separated(text: str, convert, valid, wanted: str) -> tuple:
    """Values of a comma-separated list flag, each read by `convert` and accepted by `valid`, a repeated value kept
    once, where it first appears (a list names configurations to run, and one run of each is enough); otherwise an
    ArgumentTypeError "'text': <wanted>" (`wanted` says what to give, with an example)."""
    try:
        values = tuple(convert(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(valid(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: {wanted}")
    return tuple(dict.fromkeys(values))


def joined(values: list[str] | str | None) -> str | None:
    """A comma-separated list flag given more than once (action="append"), as one list: "lru", "lfu" → "lru,lfu" (a
    single string, as a caller's own Namespace may hold, as it is)."""
    return values if values is None or isinstance(values, str) else ",".join(values)


def batch_sizes(text: str) -> tuple[int, ...]:
    """argparse type of a batch-size list flag: comma-separated whole numbers, each at least 1 (repeats kept once)."""
    return comma_separated(text, int, lambda v: v >= 1, "give batch sizes of at least 1, comma-separated, such as 1,16")
