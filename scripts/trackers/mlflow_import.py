#!/usr/bin/env python3
"""Log a dflash experiment to MLflow: the scalars of its TensorBoard event files (the tags
TensorBoard and W&B show: train/loss, train/acc/pos1, validation/tau_hat, ...) at their steps,
its config.toml as params, and its results files as artifacts. MLflow has no importer for
TensorBoard files and there is no maintained MLflow client for Rust, so this reads the event
files itself (TFRecords of `tensorflow.Event` protobufs, the subset host/src/tensorboard.rs
writes) and logs through MLflow's own Python client.

    pip install mlflow                   # or mlflow-skinny, against a tracking server
    python3 scripts/trackers/mlflow_import.py experiments/NAME --tracking-uri sqlite:///mlflow.db
    python3 scripts/trackers/mlflow_import.py experiments/NAME --tracking-uri http://host:5000 --experiment dflash
    python3 scripts/trackers/mlflow_import.py experiments/NAME --dry-run     # what would be logged, as JSON

The tracking URI is --tracking-uri, else MLFLOW_TRACKING_URI, else MLflow's default. Each call
logs a new run.
"""

import argparse
import glob
import json
import os
import struct
import sys
import tomllib

# Files of the experiment kept with the run.
ARTIFACTS = ["config.toml", "manifest.json", "summary.json", "metrics.jsonl", "eval*.json"]


def varint(buf, i):
    """A protobuf varint at buf[i:]: (value, next index)."""
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def fields(buf):
    """A protobuf message's fields: (number, value), value an int (varint), bytes (length-
    delimited) or the raw 8 or 4 bytes of a fixed64 / fixed32."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not one an event file holds")
        yield number, value


def records(path):
    """A TFRecord file's records: u64 length, u32 CRC of it, the data, u32 CRC of the data (the
    CRCs are not checked; a record cut short by a crash ends the file)."""
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i + 12 <= len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        if i + 12 + n + 4 > len(data):
            break
        yield data[i + 12 : i + 12 + n]
        i += 12 + n + 4


def scalars(path):
    """(tag, step, value, wall time in ms) of every scalar in an event file."""
    for record in records(path):
        wall, step, summary = 0.0, 0, None
        for number, value in fields(record):
            if number == 1:
                (wall,) = struct.unpack("<d", value)
            elif number == 2:
                step = value
            elif number == 5:
                summary = value
        if summary is None:
            continue  # the file-version record
        for number, value in fields(summary):
            if number != 1:
                continue
            tag, simple = None, None
            for n, v in fields(value):
                if n == 1:
                    tag = v.decode()
                elif n == 2:
                    (simple,) = struct.unpack("<f", v)
            if tag is not None and simple is not None:
                yield tag, step, simple, int(wall * 1000)


def params(config, prefix=""):
    """config.toml flattened to MLflow params: `section.key` -> its value as text."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(params(value, f"{name}."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, bool)) else str(value)
    return out


def collect(exp):
    events = sorted(glob.glob(os.path.join(exp, "events.out.tfevents.*")))
    if not events:
        sys.exit(f"{exp}: no TensorBoard event files (events.out.tfevents.*): not an experiment folder?")
    metrics = [m for path in events for m in scalars(path)]
    config_path = os.path.join(exp, "config.toml")
    config = {}
    if os.path.exists(config_path):
        with open(config_path, "rb") as f:
            config = params(tomllib.load(f))
    artifacts = sorted({p for pattern in ARTIFACTS for p in glob.glob(os.path.join(exp, pattern))})
    return metrics, config, artifacts


def log(exp, metrics, config, artifacts, args):
    import mlflow
    from mlflow.entities import Metric, Param

    if args.tracking_uri:
        mlflow.set_tracking_uri(args.tracking_uri)
    mlflow.set_experiment(args.experiment)
    client = mlflow.tracking.MlflowClient()
    name = args.run_name or os.path.basename(os.path.normpath(exp))
    with mlflow.start_run(run_name=name) as run:
        items = [Param(k, v) for k, v in config.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(run.info.run_id, params=items[i : i + 100])
        batch = [Metric(tag, value, wall, step) for tag, step, value, wall in metrics]
        for i in range(0, len(batch), 1000):  # and 1000 metrics
            client.log_batch(run.info.run_id, metrics=batch[i : i + 1000])
        for path in artifacts:
            mlflow.log_artifact(path)
        print(f"logged {len(metrics)} values of {len({m[0] for m in metrics})} metrics, {len(config)} params, "
              f"{len(artifacts)} files to run {run.info.run_id} ({mlflow.get_tracking_uri()})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exp", help="the experiment folder (experiments/NAME)")
    ap.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else MLflow's default)")
    ap.add_argument("--experiment", default="dflash", help="MLflow experiment name (default: dflash)")
    ap.add_argument("--run-name", help="MLflow run name (default: the folder's name)")
    ap.add_argument("--dry-run", action="store_true", help="print what would be logged as JSON; MLflow not needed")
    args = ap.parse_args()
    metrics, config, artifacts = collect(args.exp)
    if args.dry_run:
        json.dump({"metrics": metrics, "params": config, "artifacts": artifacts}, sys.stdout)
        print()
    else:
        log(args.exp, metrics, config, artifacts, args)


if __name__ == "__main__":
    main()
