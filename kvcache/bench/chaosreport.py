"""What `kvcache bench chaos` counts and prints: the outcomes against the undisturbed reference,
the faults, the members wrongly marked dead, and the goal line."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import asdict

from kvcache.bench.chaosfaults import Fault
from kvcache.bench.chaosload import ChaosRequest, Outcome, first_difference
from kvcache.bench.chaoswatch import DeadSighting
from kvcache.bench.report import print_table

SHOWN = 5  # first failures, differences, sightings shown


def count_outcomes(outcomes: list[Outcome], reference: dict[str, Outcome]) -> dict:
    """Per kind (greedy, seeded) and in all: sent, completed, refused and retried, failed, differing."""
    rows, failures, differences = {}, [], []
    for kind in ("greedy", "seeded", "all"):
        mine = [o for o in outcomes if kind == "all" or o.request.kind == kind]
        checked = [o for o in mine if o.ok and reference.get(o.request.label, Outcome(o.request, error="-")).ok]
        differing = [o for o in checked if _difference(o, reference[o.request.label]) is not None]
        rows[kind] = {"sent": len(mine), "completed": sum(o.ok for o in mine),
                      "refused_and_retried": sum(o.refusals > 0 for o in mine),
                      "refusals": sum(o.refusals for o in mine),
                      "failed": sum(not o.ok for o in mine), "differing": len(differing),
                      "unchecked": sum(o.ok for o in mine) - len(checked)}
        if kind == "all":
            failures = [f"{o.request.label}: {o.error}" for o in mine if not o.ok]
            differences = [_difference_record(o, reference[o.request.label]) for o in differing]
    return {"by_kind": rows, "first_failures": failures[:SHOWN], "first_differences": differences[:SHOWN]}


def reference_summary(reference: dict[str, Outcome], requests: list[ChaosRequest]) -> dict:
    failed = [o for o in reference.values() if not o.ok]
    return {"requests": len(requests), "completed": len(reference) - len(failed), "failed": len(failed),
            "first_failures": [f"{o.request.label}: {o.error}" for o in failed[:SHOWN]]}


def fault_summary(faults: list[Fault], start: float) -> dict:
    listed = []
    for f in faults:
        record = asdict(f)
        record["at_s"] = round(f.at - start, 2)
        record["back_after_s"] = round(f.back_at - f.at, 2) if f.back_at is not None else None
        del record["at"], record["back_at"]
        listed.append(record)
    return {"injected": dict(Counter(f.kind for f in faults)), "total": len(faults), "list": listed}


def dead_summary(wrong: list[DeadSighting], all_sightings: int, start: float) -> dict:
    return {"members": sorted({f"{s.role} {s.address}" for s in wrong}), "sightings": len(wrong),
            "sightings_all": all_sightings,
            "first": [{"at_s": round(s.at - start, 2), "coordinator": s.coordinator, "role": s.role,
                       "address": s.address, "source": s.source} for s in wrong[:SHOWN]]}


def print_report(result: dict) -> None:
    o, c, ref = result["options"], result["cluster"], result["reference"]
    print(f"chaos bench: a local cluster of {c['coordinators']} coordinators, {c['nodes']} kvnodes, {c['workers']} "
          f"workers, model {c['model']}, {o.get('kv_dtype', 'float32')} KV, eviction "
          f"{o.get('eviction') or 'prefix-lru'}; {ref['requests']} requests ({o['prompts']} prompts, each greedy and "
          f"seeded at temperature {result['seeded_temperature']}), {o['max_tokens']} tokens each, "
          f"{o['concurrency']} clients, {o['duration']:.0f}s of faults"
          + (f"; {o['load']} busy processes beside it" if o.get("load") else ""))
    print(f"reference on the undisturbed cluster: {ref['completed']} of {ref['requests']} completed"
          + (f"; failed: {'; '.join(ref['first_failures'])}" if ref["failed"] else ""))
    faults = result["faults"]
    injected = ", ".join(f"{kind} {n}" for kind, n in faults["injected"].items()) or "none"
    print(f"faults injected: {injected} ({faults['total']} in all)")
    print()
    rows = result["load"]["by_kind"]
    measures = [("requests sent", "sent"), ("completed", "completed"), ("refused and retried", "refused_and_retried"),
                ("failed", "failed"), ("differing from the reference", "differing")]
    if rows["all"]["unchecked"]:
        measures.append(("completed, no reference to compare", "unchecked"))
    print_table(["measure", "greedy", "seeded", "all"],
                [[label, rows["greedy"][key], rows["seeded"][key], rows["all"][key]] for label, key in measures]
                + [["members wrongly marked dead", "", "", len(result["wrongly_dead"]["members"])]], out=sys.stdout)
    print(f"streams a coordinator resumed on another worker after some tokens (its log): "
          f"{result['resumed_by_coordinators']}")
    for title, lines in (("first failures", result["load"]["first_failures"]),
                         ("first differences", [_says(d) for d in result["load"]["first_differences"]]),
                         ("wrongly marked dead", [_dead(s) for s in result["wrongly_dead"]["first"]])):
        if lines:
            print(f"\n{title}:")
            for line in lines:
                print(f"  {line}")
    if faults["list"]:
        print()
        print_table(["at s", "fault", "member", "in flight", "exit", "back after s", "note"],
                    [[f["at_s"], f["kind"], f"{f['target']} {f['address']}", _or_dash(f["in_flight"]),
                      _or_dash(f["exit_code"]), _or_dash(f["back_after_s"]),
                      f["error"] or _moved(f)]
                     for f in faults["list"]], out=sys.stdout)
    goal = result["goal"]
    print(f"\ngoal: failed 0, differing 0: {'PASS' if goal['met'] else 'FAIL'} "
          f"(failed {goal['failed']}, differing {goal['differing']})")


def _difference(outcome: Outcome, expected: Outcome) -> int | None:
    position = first_difference(outcome.tokens, expected.tokens)
    if position is None and outcome.finish_reason != expected.finish_reason:
        return len(outcome.tokens)
    return position


def _difference_record(outcome: Outcome, expected: Outcome) -> dict:
    position = _difference(outcome, expected)
    return {"request": outcome.request.label, "position": position,
            "got": outcome.tokens[position] if position < len(outcome.tokens) else None,
            "expected": expected.tokens[position] if position < len(expected.tokens) else None,
            "got_tokens": len(outcome.tokens), "expected_tokens": len(expected.tokens),
            "finish_reason": outcome.finish_reason, "expected_finish_reason": expected.finish_reason}


def _says(d: dict) -> str:
    return (f"{d['request']}: position {d['position']}: got {d['got']}, expected {d['expected']} "
            f"({d['got_tokens']} tokens, {d['finish_reason']}; reference {d['expected_tokens']}, "
            f"{d['expected_finish_reason']})")


def _dead(s: dict) -> str:
    return f"{s['role']} {s['address']} at {s['at_s']}s by {s['coordinator']} ({s['source']})"


def _moved(fault: dict) -> str:
    return f"now on {fault['new_address']}" if fault["new_address"] not in ("", fault["address"]) else ""


def _or_dash(value) -> str:
    return "-" if value is None else str(value)
