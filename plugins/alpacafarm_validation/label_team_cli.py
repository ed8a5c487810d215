"""``alpacafarm label invite NAME --dir DIR`` and ``alpacafarm label revoke NAME --dir DIR``: personal links.

An invite is stored in the session's store (only its SHA-256), so it works across restarts, and a running server
honours it at once; from the first invite on, the session labels by invite links only (a typed name is no longer
an identity). Revoking stops the link at once and frees the pair its holder was shown; their labels stay.
"""

from __future__ import annotations

import argparse
import json


def cmd_invite(args: argparse.Namespace) -> int:
    """Make ``args.name``'s invite and print their link (one JSON line: labeller, link)."""
    from alpacafarm_validation import label_identity
    from alpacafarm_validation.label_store import LabelStore

    store = LabelStore.open(args.dir, write=True)
    token = store.run("store an invite", lambda db: label_identity.invite(db, args.name))
    name = label_identity.clean_name(args.name)
    base = args.url if args.url.endswith("/") else args.url + "/"
    print(json.dumps({"labeller": name, "link": f"{base}?token={token}", "team": f"{base}team?token={token}"}))
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    """Revoke ``args.name``'s invite link."""
    from alpacafarm_validation import label_identity
    from alpacafarm_validation.label_store import LabelStore

    store = LabelStore.open(args.dir, write=True)
    name = store.run("revoke an invite", lambda db: label_identity.revoke(db, args.name))
    print(json.dumps({"revoked": name}))
    return 0
