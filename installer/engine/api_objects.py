"""Objects sent through the Kubernetes API by apply and day-2 commands alike: ``apply_api_objects``
(or, in a dry run, what it would do), and whether an apiserver runs yet."""

from __future__ import annotations

from typing import Callable

from installer.engine.context import Context, Event
from installer.host import apireach


def _ident(obj: dict) -> str:
    meta = obj["metadata"]
    return f"{obj['kind']} {meta['namespace'] + '/' if meta.get('namespace') else ''}{meta['name']}"


def api_live(ctx: Context) -> bool:
    """Whether a kube-apiserver already runs (the plane says: per the facts, or where a hosted
    tenant's is exposed): then a dry run can ask it."""
    return ctx.plane.api_live(ctx)


def apply_api_objects(ctx: Context, phase: str, objects: list[dict] | Callable[[object | None], list[dict]],
                      credential: str, then: Callable[[str], list[str]] | None = None,
                      retired_bindings: tuple[str, ...] = ()) -> Event:
    """Send ``objects`` through the API (``kube_objects.apply_objects``), or in a dry run say what that
    would do: by reading them from the running apiserver (so a converged cluster plans
    nothing), or, before any apiserver runs, that every object would be applied. ``objects``
    may be a function of the API client (None before any apiserver runs) that reads what
    decides them. ``then(url)`` runs after the objects, with the API still reachable at ``url``
    (in a dry run too, once an apiserver runs: it reads ``ctx.options.dry_run`` and only says
    what it would do); its lines join the event's. ``retired_bindings``: ClusterRoleBindings of
    earlier releases, deleted when they exist."""
    from installer.host import kube, kube_objects  # lazy: runs that never reach the API skip urllib3 and the schemas
    version = ctx.inv.spec.kubernetes.version
    if ctx.options.dry_run and not api_live(ctx):
        objects = objects(None) if callable(objects) else objects
        kube_objects.validate_objects(objects, version)
        return Event(phase, "(api)", "changed", detail=[f"would apply {_ident(o)}" for o in objects])
    with apireach.api_access(ctx.inv, ctx.remotes, ctx.material) as url, \
            kube.api_client(url, ctx.material, credential=credential) as api:
        objects = objects(api) if callable(objects) else objects
        if ctx.options.dry_run:
            done = kube_objects.plan_objects(api, objects, version)
            changed = [f"would {'create' if a == 'created' else 'replace'} {k} {n}" for k, n, a in done
                       if a != "unchanged"]
            changed += [f"would delete ClusterRoleBinding {b}" for b in retired_bindings
                        if kube.binding_exists(api, b)]
        else:
            done = kube_objects.apply_objects(api, objects, version)
            changed = [f"{action} {kind} {name}" for kind, name, action in done if action != "unchanged"]
            changed += [f"deleted ClusterRoleBinding {b}" for b in retired_bindings if kube.delete_binding(api, b)]
        if then is not None:
            changed += then(url)
    return Event(phase, "(api)", "changed" if changed else "unchanged", detail=changed)
