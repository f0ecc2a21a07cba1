# Sourced by e2e/*.sh: a private apt configuration, so that fetching Debian packages (or sources)
# needs no root and leaves the system's apt config, lists and cache untouched.
#
# private_apt_init DIR [deb-src]
#   Writes DIR/{sources.list,parts/,lists/,cache/} with `deb` lines (plus `deb-src` lines when asked)
#   derived from the machine's configured Debian sources, and sets the array APT to an apt-get command
#   that uses only them. Run "${APT[@]}" update before `download` / `source --download-only`.
private_apt_init() {
  local dir=$1 types="deb" f line
  [[ ${2:-} == deb-src ]] && types="deb deb-src"
  mkdir -p "$dir"/{lists/partial,cache/archives/partial,parts}
  # deb822 files (bookworm's default): only Debian's; a third-party repo may have no deb-src.
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] && grep -qiE '^URIs:.*debian' "$f" || continue
    sed -E "s/^Types:.*/Types: $types/" "$f" > "$dir/parts/$(basename "$f")"
  done
  : > "$dir/sources.list"
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    grep -E '^deb ' "$f" | grep -i debian | while read -r line; do
      echo "$line"
      [[ $types == deb ]] || echo "${line/deb /deb-src }"
    done >> "$dir/sources.list" || true
  done
  APT=(apt-get -q -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts="$dir/parts"
       -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" -o APT::Get::List-Cleanup=0)
}
