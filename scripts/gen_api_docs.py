#!/usr/bin/python3
"""Writes docs/api.md, the API reference, from the comments of api/kvfence/v1/*.proto.

    scripts/gen_api_docs.py                 regenerate docs/api.md
    scripts/gen_api_docs.py --check         exit 1 (with a diff) when docs/api.md is not current
    options: --protoc PATH (default: protoc on PATH), --out FILE (default: docs/api.md)

protoc parses the protos (--include_source_info --descriptor_set_out) and this
script reads the FileDescriptorSet with Debian's python3-protobuf: services
and their methods (request, response, streaming), messages and their fields
(number, type, label, oneof), enums and their values, each with the comment
written above it in the .proto (or after it on the same line). Nothing here
restates the contract: when a comment changes, the reference changes with it,
and ctest `api_docs_current` (and scripts/test.sh) fail until docs/api.md is
regenerated and committed. The output depends only on the protos: no dates,
no versions, no paths of this machine.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile

from google.protobuf import descriptor_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "api")
# Files in the order of the reference: the shared types first, then the
# services by audience (engines and operators, nodes, node to node).
PROTOS = ["kvfence/v1/types.proto", "kvfence/v1/control.proto", "kvfence/v1/node.proto", "kvfence/v1/peer.proto"]

# Field numbers of descriptor.proto, the steps of a SourceCodeInfo path.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE, FILE_SYNTAX = 4, 5, 6, 12
MSG_FIELD, MSG_NESTED, MSG_ENUM, MSG_ONEOF = 2, 3, 4, 8
ENUM_VALUE = 2
SERVICE_METHOD = 2

FDP = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    FDP.TYPE_DOUBLE: "double", FDP.TYPE_FLOAT: "float", FDP.TYPE_INT64: "int64", FDP.TYPE_UINT64: "uint64",
    FDP.TYPE_INT32: "int32", FDP.TYPE_FIXED64: "fixed64", FDP.TYPE_FIXED32: "fixed32", FDP.TYPE_BOOL: "bool",
    FDP.TYPE_STRING: "string", FDP.TYPE_BYTES: "bytes", FDP.TYPE_UINT32: "uint32", FDP.TYPE_SFIXED32: "sfixed32",
    FDP.TYPE_SFIXED64: "sfixed64", FDP.TYPE_SINT32: "sint32", FDP.TYPE_SINT64: "sint64",
}


def descriptor_set(protoc):
    """Runs protoc on the protos; returns the FileDescriptorSet with source info."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "api.pb")
        cmd = [protoc, "--proto_path=" + PROTO_DIR, "--include_source_info", "--descriptor_set_out=" + out] + PROTOS
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0:
            sys.exit("gen_api_docs: %s failed:\n%s" % (" ".join(cmd), proc.stdout.decode(errors="replace")))
        fds = descriptor_pb2.FileDescriptorSet()
        with open(out, "rb") as f:
            fds.ParseFromString(f.read())
    return fds


class Comments:
    """The comments of one file, by SourceCodeInfo path."""

    def __init__(self, fdp):
        self.by_path = {}
        for loc in fdp.source_code_info.location:
            self.by_path[tuple(loc.path)] = loc

    def get(self, path, detached=False):
        loc = self.by_path.get(tuple(path))
        if loc is None:
            return ""
        parts = list(loc.leading_detached_comments) if detached else []
        if loc.leading_comments:
            parts.append(loc.leading_comments)
        if loc.trailing_comments:
            parts.append(loc.trailing_comments)
        return "\n".join(clean(p) for p in parts if p.strip()).strip("\n")


def clean(comment):
    """A // comment as protoc gives it (one leading space per line) to plain lines."""
    lines = comment.rstrip("\n").split("\n")
    return "\n".join(line[1:] if line.startswith(" ") else line for line in lines).rstrip()


def block(text):
    """A comment as Markdown: paragraphs stay paragraphs; a paragraph with
    indented lines (aligned lists, examples) becomes a text block so that its
    alignment survives."""
    out = []
    for para in text.split("\n\n"):
        lines = para.split("\n")
        if is_list(lines):
            first = next(i for i, line in enumerate(lines) if line.startswith("- "))
            intro = "\n".join(lines[:first])
            out.append(md_text((intro + "\n\n" if intro else "") + "\n".join(lines[first:])))
        elif any(line.startswith(" ") for line in lines):
            out.append("```text\n" + para + "\n```")
        else:
            out.append(md_text(para))
    return "\n\n".join(out)


def md_text(text):
    """Prose as Markdown: outside `code` spans, < and * are escaped (comments
    write <node id> and *_ms, which Markdown would take for HTML and emphasis)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def is_list(lines):
    """True for a paragraph that is a "- " list whose indented lines only
    continue its items (no aligned columns): Markdown renders it as written."""
    seen_item = False
    for line in lines:
        if line.startswith("- "):
            seen_item = True
        elif line.startswith(" "):
            if not seen_item or not line.startswith("  ") or re.search(r"\S {3,}\S", line):
                return False
    return seen_item


def cell(text):
    """A comment in one table cell: one line, pipes escaped."""
    words = " ".join(line.strip() for line in text.split("\n") if line.strip())
    return md_text(words).replace("|", "\\|")


def anchor(full_name):
    return full_name.lstrip(".").replace(".", "-").lower()


class Reference:
    def __init__(self, fds):
        self.files = {f.name: f for f in fds.file}
        self.known = set()  # full names of messages and enums documented here
        for f in fds.file:
            pkg = "." + f.package
            for m in f.message_type:
                self._collect(pkg, m)
            for e in f.enum_type:
                self.known.add(pkg + "." + e.name)
        self.out = []

    def _collect(self, scope, m):
        name = scope + "." + m.name
        self.known.add(name)
        for n in m.nested_type:
            self._collect(name, n)
        for e in m.enum_type:
            self.known.add(name + "." + e.name)

    def link(self, type_name):
        short = type_name.split(".")[-1]
        if type_name in self.known:
            return "[%s](#%s)" % (short, anchor(type_name))
        return "`%s`" % type_name.lstrip(".")

    def field_type(self, f, msg_by_name):
        if f.type in (FDP.TYPE_MESSAGE, FDP.TYPE_ENUM):
            entry = msg_by_name.get(f.type_name)
            if entry is not None and entry.options.map_entry:
                k, v = entry.field[0], entry.field[1]
                return "map<%s, %s>" % (self.field_type(k, msg_by_name), self.field_type(v, msg_by_name))
            return self.link(f.type_name)
        return "`%s`" % SCALARS[f.type]

    def w(self, text=""):
        self.out.append(text)

    def render(self):
        self.w("# kvfence API reference (kvfence.v1)")
        self.w()
        self.w("Generated from the comments of `api/kvfence/v1/*.proto` by `scripts/gen_api_docs.py`: edit the")
        self.w("protos, then run that script and commit both (ctest `api_docs_current` fails until this file is")
        self.w("current). The words (room, lease, drained, fenced, ...) are defined in [design.md](design.md) §1;")
        self.w("status codes and conventions are in each file's opening comment below. The services are served")
        self.w("with server reflection, so `grpcurl` needs no proto files; the `kvfence` CLI ([cli.md](cli.md))")
        self.w("wraps Admin.")
        self.w()
        self.w("## Contents")
        self.w()
        for name in PROTOS:
            f = self.files[name]
            self.w("- [`%s`](#%s)" % (name, anchor("file." + name.replace("/", ".").replace(".proto", ""))))
            for s in f.service:
                full = "." + f.package + "." + s.name
                self.w("  - service [%s](#%s): %s" % (s.name, anchor(full), ", ".join(m.name for m in s.method)))
            if f.message_type:
                self.w("  - messages: " + ", ".join(self.link("." + f.package + "." + m.name) for m in f.message_type))
            if f.enum_type:
                self.w("  - enums: " + ", ".join(self.link("." + f.package + "." + e.name) for e in f.enum_type))
        for name in PROTOS:
            self.file(self.files[name])
        return "\n".join(self.out).rstrip("\n") + "\n"

    def file(self, f):
        c = Comments(f)
        pkg = "." + f.package
        self.w()
        self.w('<a id="%s"></a>' % anchor("file." + f.name.replace("/", ".").replace(".proto", "")))
        self.w()
        self.w("## %s" % f.name)
        self.w()
        head = c.get([FILE_SYNTAX], detached=True)
        if head:
            self.w(block(head))
            self.w()
        msg_by_name = {}

        def index(scope, m):
            msg_by_name[scope + "." + m.name] = m
            for n in m.nested_type:
                index(scope + "." + m.name, n)

        for m in f.message_type:
            index(pkg, m)
        for i, s in enumerate(f.service):
            self.service(c, pkg, s, [FILE_SERVICE, i])
        if f.message_type:
            self.w("### Messages of %s" % f.name)
            self.w()
            for i, m in enumerate(f.message_type):
                self.message(c, pkg, m, [FILE_MESSAGE, i], msg_by_name)
        if f.enum_type:
            self.w("### Enums of %s" % f.name)
            self.w()
            for i, e in enumerate(f.enum_type):
                self.enum(c, pkg, e, [FILE_ENUM, i])

    def service(self, c, pkg, s, path):
        full = pkg + "." + s.name
        self.w('<a id="%s"></a>' % anchor(full))
        self.w()
        self.w("### service %s" % s.name)
        self.w()
        text = c.get(path)
        if text:
            self.w(block(text))
            self.w()
        self.w("| method | request | response |")
        self.w("|---|---|---|")
        for m in s.method:
            req = ("stream " if m.client_streaming else "") + self.link(m.input_type)
            rsp = ("stream " if m.server_streaming else "") + self.link(m.output_type)
            self.w("| [%s](#%s) | %s | %s |" % (m.name, anchor(full + "." + m.name), req, rsp))
        self.w()
        for i, m in enumerate(s.method):
            self.w('<a id="%s"></a>' % anchor(full + "." + m.name))
            self.w()
            self.w("#### %s.%s" % (s.name, m.name))
            self.w()
            sig = "rpc %s(%s%s) returns (%s%s)" % (
                m.name, "stream " if m.client_streaming else "", m.input_type.split(".")[-1],
                "stream " if m.server_streaming else "", m.output_type.split(".")[-1])
            self.w("`/%s/%s`: `%s`" % (full.lstrip("."), m.name, sig))
            self.w()
            text = c.get(path + [SERVICE_METHOD, i])
            if text:
                self.w(block(text))
                self.w()

    def message(self, c, scope, m, path, msg_by_name):
        full = scope + "." + m.name
        if m.options.map_entry:
            return
        self.w('<a id="%s"></a>' % anchor(full))
        self.w()
        self.w("#### %s" % full.lstrip(".").split(".", 2)[-1])
        self.w()
        text = c.get(path)
        if text:
            self.w(block(text))
            self.w()
        if m.field:
            self.w("| field | # | type | description |")
            self.w("|---|---|---|---|")
            for i, f in enumerate(m.field):
                typ = self.field_type(f, msg_by_name)
                if f.label == FDP.LABEL_REPEATED and not typ.startswith("map<"):
                    typ = "repeated " + typ
                note = ""
                if f.HasField("oneof_index") and not f.proto3_optional:
                    note = "(oneof `%s`) " % m.oneof_decl[f.oneof_index].name
                elif f.proto3_optional:
                    note = "(optional) "
                desc = note + cell(c.get(path + [MSG_FIELD, i]))
                self.w("| `%s` | %d | %s | %s |" % (f.name, f.number, typ, desc.strip()))
            self.w()
        else:
            self.w("No fields.")
            self.w()
        for i, n in enumerate(m.nested_type):
            self.message(c, full, n, path + [MSG_NESTED, i], msg_by_name)
        for i, e in enumerate(m.enum_type):
            self.enum(c, full, e, path + [MSG_ENUM, i])

    def enum(self, c, scope, e, path):
        full = scope + "." + e.name
        self.w('<a id="%s"></a>' % anchor(full))
        self.w()
        self.w("#### enum %s" % full.lstrip(".").split(".", 2)[-1])
        self.w()
        text = c.get(path)
        if text:
            self.w(block(text))
            self.w()
        self.w("| value | # | description |")
        self.w("|---|---|---|")
        for i, v in enumerate(e.value):
            self.w("| `%s` | %d | %s |" % (v.name, v.number, cell(c.get(path + [ENUM_VALUE, i]))))
        self.w()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--protoc", default="protoc")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "api.md"))
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args()
    text = Reference(descriptor_set(args.protoc)).render()
    if args.check:
        try:
            with open(args.out, encoding="utf-8") as f:
                old = f.read()
        except FileNotFoundError:
            old = ""
        if old != text:
            diff = difflib.unified_diff(old.splitlines(True), text.splitlines(True), args.out, "regenerated")
            sys.stdout.writelines(list(diff)[:200])
            print("gen_api_docs: %s is not current with api/kvfence/v1/*.proto: run scripts/gen_api_docs.py "
                  "and commit it" % os.path.relpath(args.out, ROOT))
            return 1
        print("gen_api_docs: %s is current" % os.path.relpath(args.out, ROOT))
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print("gen_api_docs: wrote %s (%d lines)" % (os.path.relpath(args.out, ROOT), text.count("\n")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
