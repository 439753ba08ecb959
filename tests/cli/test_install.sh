#!/usr/bin/env bash
# make install / uninstall into a staging DESTDIR: the installed program runs
# the installed model with the same output as the build tree's, and uninstall
# leaves nothing behind. (bin/k3 is taken as built: -o keeps make from
# rebuilding it inside the suite.)
. "$(dirname "$0")/lib.sh"
S=$PWD/$OUT/stage; rm -rf "$S"
expect_exit install 0 make -s -o bin/k3 install DESTDIR="$S" PREFIX=/usr
for f in usr/bin/k3 usr/share/k3/models/default/config.json usr/share/k3/models/default/model.safetensors \
         usr/share/k3/models/default/tiktoken.model usr/share/k3/models/chat/model.safetensors \
         usr/share/k3/models/chat/tokenizer_config.json usr/share/doc/k3/README.md usr/share/doc/k3/docs/serve.md usr/share/doc/k3/docs/dashboard.png; do
  [ -f "$S/$f" ] && pass "installed:$f" || fail "installed:$f"
done
[ -x "$S/usr/bin/k3" ] && pass installed:executable || fail installed:executable
cmp -s bin/k3 "$S/usr/bin/k3" && pass installed:same-program || fail installed:same-program
# the installed program on the installed model writes what the build tree's writes on models/default
bin/k3 run models/default --prompt "Once upon a time" --gen 8 --threads 1 >"$OUT/tree.txt" 2>/dev/null
(cd / && "$S/usr/bin/k3" run "$S/usr/share/k3/models/default" --prompt "Once upon a time" --gen 8 --threads 1) \
  >"$OUT/installed.txt" 2>/dev/null
if [ -s "$OUT/tree.txt" ] && cmp -s "$OUT/tree.txt" "$OUT/installed.txt"; then pass installed:runs-same
else fail installed:runs-same "$(head -c 200 "$OUT/installed.txt")"; fi
# every relative link of the installed README resolves in the installed tree
miss=$(grep -o '](docs/[^)#]*' "$S/usr/share/doc/k3/README.md" | sed 's/^](//' | sort -u |
       while read -r l; do [ -e "$S/usr/share/doc/k3/$l" ] || echo "$l"; done)
check installed:readme-links "$miss" ""
expect_exit uninstall 0 make -s -o bin/k3 uninstall DESTDIR="$S" PREFIX=/usr
left=$(cd "$S" && find . -type f | head -3)
check uninstall:nothing-left "$left" ""
rm -rf "$S"
finish
