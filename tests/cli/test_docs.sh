#!/usr/bin/env bash
# The README and docs/ link to each other: every relative link (and image) in
# README.md and docs/*.md must name a file that exists, and a link with a
# #fragment into a Markdown file must name one of its headings (GitHub's ids:
# lower case, punctuation dropped, each space a hyphen). Links inside code are
# not links. The checker is first shown a page with broken links, so a checker
# that finds nothing cannot pass.
. "$(dirname "$0")/lib.sh"
if ! command -v python3 >/dev/null; then skip docs:links "no python3"; finish; exit; fi

# check_links FILE...: one line "FILE: TARGET: why" per broken link
check_links() {
  python3 - "$@" <<'EOF'
import os, re, sys
def slugs(path):
    ids, seen, fence = set(), {}, False
    for line in open(path, encoding='utf-8'):
        if line.startswith('```'): fence = not fence
        m = None if fence else re.match(r'#{1,6}\s+(.*?)\s*#*\s*$', line)
        if not m: continue
        t = re.sub(r'[^\w\- ]', '', m.group(1).replace('`', '').lower())
        s = t.replace(' ', '-')
        n = seen.get(s, 0); seen[s] = n + 1
        ids.add(s if n == 0 else '%s-%d' % (s, n))
    return ids
bad = 0
for f in sys.argv[1:]:
    fence = False
    for no, line in enumerate(open(f, encoding='utf-8'), 1):
        if line.startswith('```'): fence = not fence; continue
        if fence or line.startswith('    '): continue
        line = re.sub(r'`[^`]*`', '', line)
        for target in re.findall(r'\]\(([^)\s]+)(?:\s+"[^"]*")?\)', line):
            if re.match(r'[a-z]+:', target): continue      # http:, https:, mailto:
            path, _, frag = target.partition('#')
            full = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            if not os.path.exists(full):
                print('%s:%d: %s: no such file' % (f, no, target)); bad += 1
            elif frag and full.endswith('.md') and frag not in slugs(full):
                print('%s:%d: %s: no such heading' % (f, no, target)); bad += 1
sys.exit(1 if bad else 0)
EOF
}

# the checker catches a missing file, a missing heading and a link out of the
# tree, and passes links in code, external links and a good fragment
T=$OUT/t; rm -rf "$T"; mkdir -p "$T/docs"
printf '# Top\n\n## A `b` c: d\n' >"$T/docs/ok.md"
cat >"$T/README.md" <<'EOF'
# Top

[fine](docs/ok.md) [frag](docs/ok.md#a-b-c-d) [self](#top) [web](https://example.com/x.md)
`[in code](docs/none.md)`

    [indented code](docs/none.md)

[gone](docs/none.md) [nohead](docs/ok.md#nope) ![img](docs/none.png)
EOF
check_links "$T/README.md" "$T/docs/ok.md" >"$OUT/t.out"
check checker:fails-on-broken "$?" 1
check checker:finds-each "$(sed 's/.*: \([^:]*\): .*/\1/' "$OUT/t.out" | tr '\n' ' ')" "docs/none.md docs/ok.md#nope docs/none.png "

# the real pages
check_links README.md docs/*.md >"$OUT/links.out"
check docs:links "$?$(head -c 2000 "$OUT/links.out")" 0
rm -rf "$T"
finish
