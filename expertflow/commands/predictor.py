"""`expertflow predictor …`: train a route predictor on traces and evaluate it against the heuristic baselines.

Owns: argument parsing and output of `predictor train`, `predictor fit-next` and `predictor eval`. Does not know:
the network, the training recipe or the metric definitions (all in `expertflow.predictor`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import warnings

from expertflow.commands import check_positive, check_threads
from expertflow.errors import first_line

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `predictor` with `train`, `fit-next` and `eval` to the top-level `expertflow` parser."""
    parser = subparsers.add_parser("predictor", help="train and evaluate the route-path predictor",
                                   description="The route-path predictor: expert probabilities of every token at "
                                               "every MoE layer, from token ids.")
    sub = parser.add_subparsers(dest="predictor_command", required=True)
    _add_train(sub)
    _add_fit_next(sub)
    _add_eval(sub)


def _add_traces(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--trace", required=True, action="append", type=_path, metavar="TRACE",
                   help=f"{help_text}; repeat for several files; a directory means its *.safetensors")
    p.add_argument("--tasks", metavar="T[,T...]",
                   help="keep only traces whose metadata 'task' is listed (e.g. chat,code for a cross-domain split; "
                        "`trace record --task` stores it)")
    p.add_argument("--split", metavar="S", help="keep only traces whose metadata 'split' is S (train or test; "
                                                "`trace record --split` stores it)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a predictor on recorded traces (they need token ids)",
                       description="Train a route-path predictor (and its next-token head) on traces recorded with "
                                   "`expertflow trace record`; writes config.json + model.safetensors to --out.")
    _add_traces(p, "training trace")
    p.add_argument("--out", required=True, type=_path, metavar="DIR",
                   help="directory to write config.json + model.safetensors")
    p.add_argument("--init-embeddings", type=_path, metavar="MODEL",
                   help="the traced model's directory (or safetensors file): its input embeddings become fixed "
                        "per-token features of the predictor, which helps on tokens the traces never show")
    p.add_argument("--epochs", type=int, metavar="N", help="most epochs (default 36; early stopping may end sooner)")
    p.add_argument("--lr", type=float, metavar="LR", help="peak learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed (default 0)")
    p.add_argument("--d-model", type=int, metavar="N", help="network width (default 128)")
    p.add_argument("--d-ff", type=int, metavar="N", help="feed-forward width (default 512)")
    p.add_argument("--encoder-layers", type=int, metavar="N", help="encoder layers (default 1)")
    p.add_argument("--decoder-layers", type=int, metavar="N", help="decoder layers (default 3)")
    p.add_argument("--val-fraction", type=float, metavar="F",
                   help="share of sequences held out for early stopping (default 0.1; 0 = none, train all epochs)")
    p.add_argument("--max-minutes", type=float, metavar="M",
                   help="time limit of the whole run, the next-token head included: no epoch starts after M minutes "
                        "(the network and the head each run at least one; default: no limit)")
    p.add_argument("--vocab-size", type=int, metavar="V",
                   help="the traced model's vocabulary (default: from the config.json of --init-embeddings, else of "
                        "the traces' model directory, else the embedding table's rows, else the largest token id + 1)")
    p.add_argument("--next-hidden", type=int, metavar="N",
                   help="width of the next-token head fitted after training (default 768; 0 = none)")
    p.add_argument("--next-epochs", type=int, metavar="N",
                   help="epochs of the next-token head (default 20; the best on validation is kept)")
    _add_window_options(p, "next-")
    p.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    p.set_defaults(func=_train)


def _add_fit_next(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit-next", help="fit (or refit) a trained predictor's next-token head, the rest frozen",
                       description="The next-token head guesses, at each token t and for each window of the "
                                   "tokens that follow it (by default t+1, t+2, t+3 … t+4 and t+5 … t+8; see "
                                   "--windows), the experts at least one of the window's tokens will route to, which "
                                   "the expertflow cache policy uses to judge what the next steps need. The "
                                   "predictions for the tokens themselves do not change. By default the head is "
                                   "validated on the split the predictor was trained with (the seed and validation "
                                   "fraction in its config.json, info.train_config): give the traces it was trained "
                                   "on, in the same order.")
    p.add_argument("--predictor", required=True, type=_path, metavar="DIR", help="a trained predictor directory")
    _add_traces(p, "training trace (the ones the predictor was trained on)")
    p.add_argument("--out", type=_path, metavar="DIR",
                   help="where to write the predictor (default: replace DIR's files)")
    p.add_argument("--hidden", type=int, default=768, metavar="N", help="the head's hidden width (default 768)")
    _add_window_options(p, "")
    p.add_argument("--epochs", type=int, default=20, metavar="N",
                   help="epochs (default 20; the best on validation is kept)")
    p.add_argument("--seed", type=int, metavar="S",
                   help="random seed, which also picks the validation sequences (default: the predictor's training "
                        "seed, from info.train_config in its config.json; 0 when not recorded)")
    p.add_argument("--val-fraction", type=float, metavar="F",
                   help="share of sequences held out for validation (default: the predictor's, from "
                        "info.train_config; 0.1 when not recorded; 0 = none, the last epoch is kept)")
    p.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    p.set_defaults(func=_fit_next)


def _add_window_options(p: argparse.ArgumentParser, prefix: str) -> None:
    """--{prefix}windows ENDS or --{prefix}offsets K: which following tokens the next-token head predicts."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(f"--{prefix}windows", type=_windows, metavar="ENDS",
                       help="windows of following tokens the next-token head predicts, by last offset (default "
                            "1,2,4,8: t+1, t+2, any of t+3 … t+4, any of t+5 … t+8)")
    group.add_argument(f"--{prefix}offsets", type=int, metavar="K",
                       help=f"one window per token, the next 1 … K (same as --{prefix}windows 1,2,…,K)")


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="batch accuracy and token recall of a predictor, next to the baselines",
                       description="Score a predictor on test traces: batch accuracy (b_acc), token-level top-k "
                                   "recall and precision, beside the prev_step, prev_layer and frequency baselines.")
    p.add_argument("--predictor", required=True, type=_path, metavar="DIR", help="a trained predictor directory")
    _add_traces(p, "test trace")
    p.add_argument("--batch-size", type=int, default=16, metavar="B",
                   help="sequences decoding together; b_acc is computed per step of the trace rebatched to B "
                        "(default 16)")
    p.add_argument("--phase", choices=["decode", "prefill", "all"], default="decode",
                   help="tokens scored (default: decode)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON document")
    p.set_defaults(func=_eval)


def _load(args: argparse.Namespace):
    import torch

    from expertflow.predictor.data import load_traces

    check_threads(args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    return load_traces(args.trace, tasks, args.split)


def _train(args: argparse.Namespace) -> int:
    from expertflow.predictor.session import check_predictor_dir
    from expertflow.predictor.train import TrainConfig, train, with_overrides

    try:
        check_positive(args.max_minutes, "--max-minutes")
        check_predictor_dir(args.out, "--out")
        if args.init_embeddings is not None and not os.path.exists(args.init_embeddings):
            raise ValueError(f"--init-embeddings {args.init_embeddings}: no such model directory or safetensors file")
        with _warnings_as_lines("predictor train"):
            trace = _load(args)
        config = with_overrides(TrainConfig(), epochs=args.epochs, lr=args.lr, seed=args.seed, d_model=args.d_model,
                                d_ff=args.d_ff, encoder_layers=args.encoder_layers,
                                decoder_layers=args.decoder_layers, val_fraction=args.val_fraction,
                                max_minutes=args.max_minutes, vocab_size=args.vocab_size,
                                init_embeddings=args.init_embeddings, next_hidden=args.next_hidden,
                                next_epochs=args.next_epochs,
                                next_windows=_chosen_windows(args.next_windows, args.next_offsets, "--next-offsets"))
        others = _other_files(args.out)
        with _warnings_as_lines("predictor train", _TRAIN_FLAGS):
            predictor = train(trace, config, out=args.out, progress=not args.json)
    except (ValueError, OSError) as exc:
        return _fail("predictor train", _as_flags(exc, _TRAIN_FLAGS))
    except (RuntimeError, MemoryError) as exc:
        if not _out_of_memory(exc):
            raise
        return _fail("predictor train", f"out of memory ({_first_line(exc)}); lower --d-model, --d-ff or "
                                        "--next-hidden, or give fewer or shorter traces")
    if others:
        print(f"expertflow predictor train: warning: {args.out} still holds {', '.join(others)} from the predictor "
              "it replaced; they may not describe the new one", file=sys.stderr)
    info = predictor.info
    recall = info["best_val_recall_at_k"]  # None without a validation set
    head = info.get("next_head")
    summary = {"out": args.out, "tokens": info["tokens"], "parameters": predictor.parameters_count(),
               "epochs_run": info["epochs_run"], "best_epoch": info["best_epoch"], "best_val_recall_at_k": recall,
               "next_epochs_run": len(head["history"]) if head else None, "stopped_by": info["stopped_by"],
               "seconds": info["total_seconds"]}  # the whole run, the next-token head included
    if args.json:
        print(json.dumps(summary))
    else:
        scored = (f"best validation top-k recall {recall:.4f} (epoch {summary['best_epoch']})" if recall is not None
                  else "no validation set (--val-fraction 0, or too few sequences to hold some out): the last "
                       "epoch's weights were kept")
        fitted = f" (then the next-token head for {summary['next_epochs_run']})" if head else ""
        parts = (f" ({info['parameters']} + {summary['parameters'] - info['parameters']} in the next-token head)"
                 if head else "")
        print(f"wrote {args.out}: {summary['parameters']} parameters{parts}, trained on {summary['tokens']} tokens for "
              f"{summary['epochs_run']} epochs{fitted} in {summary['seconds']} s; {scored}")
    return 0


def _fit_next(args: argparse.Namespace) -> int:
    from expertflow.predictor import load_predictor
    from expertflow.predictor.session import check_predictor_dir
    from expertflow.predictor.train import NEXT_WINDOWS, fit_next_head

    out = args.out if args.out is not None else args.predictor
    try:
        for name in ("hidden", "epochs"):
            check_positive(getattr(args, name), f"--{name}", integer=True)
        windows = _chosen_windows(args.windows, args.offsets, "--offsets") or NEXT_WINDOWS
        check_threads(args.threads)
        if args.out is not None:
            check_predictor_dir(out, "--out")
        predictor = load_predictor(args.predictor)
        if args.out is None:  # replaced in place: a predictor's directory, which must be writable
            check_predictor_dir(out, "--predictor")
        with _warnings_as_lines("predictor fit-next"):
            facts = fit_next_head(predictor, _load(args), hidden=args.hidden, windows=windows, epochs=args.epochs,
                                  seed=args.seed, val_fraction=args.val_fraction, progress=not args.json)
        predictor.save(out)
    except (ValueError, OSError) as exc:
        return _fail("predictor fit-next", _as_flags(exc, ("seed", "val_fraction", "hidden")))
    except (RuntimeError, MemoryError) as exc:
        if not _out_of_memory(exc):
            raise
        return _fail("predictor fit-next", f"out of memory ({_first_line(exc)}); lower --hidden, or give fewer or "
                                           "shorter traces")
    summary = {"out": out, **{k: v for k, v in facts.items() if k != "history"}}
    if args.json:
        print(json.dumps(summary))
    else:
        by_window = ", ".join(f"{r:.3f}" for r in facts["best_val_recall_by_window"])
        scored = (f"validation top-k recall of their routes {by_window} (epoch {facts['best_epoch']})"
                  if facts["val_pairs"] else "no validation set (--val-fraction 0, or too few sequences to hold some "
                                             "out): the last epoch's head was kept")
        print(f"wrote {out}: next-token head of width {facts['hidden']} for windows ending "
              f"{','.join(map(str, facts['windows']))} tokens ahead, fitted on {facts['pairs']} tokens in "
              f"{facts['seconds']} s; {scored}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from expertflow.predictor import load_predictor
    from expertflow.predictor.evaluate import evaluate

    try:
        check_positive(args.batch_size, "--batch-size", integer=True)
        check_threads(args.threads)
        predictor = load_predictor(args.predictor)
        with _warnings_as_lines("predictor eval"):
            report = evaluate(predictor, _load(args), args.batch_size, args.phase, progress=not args.json)
    except (ValueError, OSError) as exc:
        return _fail("predictor eval", exc)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"batch size {report['batch_size']} ({args.phase} tokens)")
    print(f"{'':12s} {'b_acc':>7s} {'recall@k':>9s} {'precision@k':>12s}")
    rows = {"predictor": report, **report["baselines"]}
    for name, r in rows.items():
        print(f"{name:12s} {r['b_acc']:7.4f} {r['token_recall_at_k']:9.4f} {_figure(r['token_precision_at_k'], 12)}")
    return 0


def _figure(value: float | None, width: int) -> str:
    """A metric for the text table: four decimals, or n/a where it is undefined (None, JSON null)."""
    return f"{'n/a':>{width}s}" if value is None else f"{value:{width}.4f}"


@contextlib.contextmanager
def _warnings_as_lines(command: str, flags: tuple[str, ...] = ()):
    """Show warnings raised inside as `expertflow <command>: warning: …` on stderr (settings named as `flags`), like
    the command's own, instead of Python's format with the library's file, line and source."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"expertflow {command}: warning: {_as_flags(message, flags)}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


_TRAIN_FLAGS = ("epochs", "lr", "seed", "d_model", "d_ff", "encoder_layers", "decoder_layers", "val_fraction",
                "max_minutes", "vocab_size", "next_hidden", "next_epochs", "init_embeddings")


def _as_flags(exc: BaseException, names: tuple[str, ...]) -> str:
    """The error's text with settings named as the flags that set them ("epochs=0 …" → "--epochs 0 …")."""
    text = str(exc)
    for name in names:
        text = re.sub(rf"\b{name}=", f"--{name.replace('_', '-')} ", text)
    return text


def _other_files(path: str) -> list[str]:
    """Files in a predictor directory that are not the predictor's own (a report, notes), sorted."""
    from expertflow.predictor.session import CONFIG_FILE, COUNTS_FILE, WEIGHTS_FILE

    names = os.listdir(path) if os.path.isdir(path) else []
    return sorted(set(names) - {CONFIG_FILE, COUNTS_FILE, WEIGHTS_FILE})


def _out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a failed allocation (torch's allocators raise RuntimeError, Python's MemoryError)."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "allocate" in text or "out of memory" in text


def _first_line(exc: BaseException) -> str:
    return first_line(exc)[:200]


def _path(text: str) -> str:
    """argparse type of a path: an empty one (an unset shell variable) would be read as the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path, which would be read as the current directory (an unset "
                                         "shell variable?); give the path")
    return text


def _fail(command: str, exc: BaseException | str) -> int:
    print(f"expertflow {command}: error: {exc}", file=sys.stderr)
    return 2


def _windows(text: str) -> tuple[int, ...]:
    """argparse type of --windows: comma-separated increasing offsets, e.g. 1,2,4,8."""
    from expertflow.predictor.model import MAX_NEXT_TOKENS, check_windows

    try:
        return check_windows([int(part) for part in text.split(",")], training=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give increasing offsets of at least 1 and at most "
                                         f"{MAX_NEXT_TOKENS}, comma-separated, such as 1,2,4,8 (t+1, t+2, any of "
                                         "t+3 … t+4, any of t+5 … t+8)") from None


def _chosen_windows(windows: tuple[int, ...] | None, offsets: int | None, flag: str) -> tuple[int, ...] | None:
    """The windows given directly, or one per token for `offsets` K (None when neither was given)."""
    from expertflow.predictor.model import MAX_NEXT_TOKENS

    if offsets is None:
        return windows
    if not 1 <= offsets <= MAX_NEXT_TOKENS:
        raise ValueError(f"{flag} {offsets} must be at least 1 and at most {MAX_NEXT_TOKENS} (the farthest token the "
                         "next-token head predicts)")
    return tuple(range(1, offsets + 1))
