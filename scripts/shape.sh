#!/usr/bin/env bash
# shape.sh: counts the shapes issue #52 wants gone from the code, by grep, so a change can
# show its before and after. It reads the tree and builds nothing.
#   bash scripts/shape.sh            # the report; exits 0
#   bash scripts/shape.sh --strict   # exits 1 on a response stream read by hand, a production
#                                    # file over 900 lines, an unexplained function over 120
#                                    # lines or a public `Result<_, String>` (the test
#                                    # command's lint stage runs it)
#
# 1. Response streams read by hand outside the runtime's driver (services/runtime/src/reader*):
#    a function that matches a `Piece` or a `Received` itself, calls `reader.next()`, or
#    collects a stream (`.collect().await`), and `ResponseStream::collect` itself. Every
#    reader of a response stream is to be an encoder driven by `Reader::drive` (see
#    docs/architecture.md#one-way-to-read-a-response-stream). Test code (files named
#    tests.rs, tests/ folders, a trailing `#[cfg(test)] mod tests { .. }`) is not counted:
#    tests read the client's own stream on purpose. bench/ is not either: it measures the
#    client itself.
# 2. Files over 900 lines (test files included: they are read too).
# 3. Functions over 120 lines (a `fn` to the `}` at its own indentation; tests excluded). One
#    whose comments just above it (doc or plain, attributes between) say "Long because"
#    and why is listed apart, as explained: a list of metric definitions, say, is long
#    and reads best whole.
# 4. `Result<_, String>` in the public functions of library crates (schema/, services/* but
#    the CLI, whose library is its binary's inside), signatures spanning lines included.
set -euo pipefail
cd "$(dirname "$0")/.."

strict=0
[ "${1:-}" = --strict ] && strict=1

# The Rust sources of the libraries and services, test files left out.
sources() {
  find schema/src services -name '*.rs' -path '*/src/*' \
    ! -name tests.rs ! -path '*/tests/*' ! -path '*/target/*' | sort
}

# Prints "file:line fn-name" for every function that reads a response stream by hand.
loops() {
  perl -e '
    my @files = @ARGV;
    for my $f (@files) {
      next if $f =~ m{services/runtime/src/reader(\.rs|/)};
      open(my $h, "<", $f) or next;
      local $/; my $text = <$h>; close $h;
      # Test code at the end of a file is not counted.
      $text =~ s/\n#\[cfg\(test\)\]\s*\nmod tests \{.*\z//s;
      # Where each function starts, to name the one a match is in.
      my @fns;
      while ($text =~ /^[ \t]*(?:pub(?:\([a-z]+\))? )?(?:async )?fn ([a-z_0-9]+)/mg) {
        push @fns, [ $-[0], $1 ];
      }
      my %seen;
      my $report = sub {
        my ($at) = @_;
        my ($start, $name) = (0, "(top level)");
        for my $fn (@fns) { last if $fn->[0] > $at; ($start, $name) = @$fn; }
        my $line = 1 + (() = substr($text, 0, $start) =~ /\n/g);
        print "$f:$line $name\n" unless $seen{$start}++;
      };
      my $is_client = $f =~ m{services/runtime/src/client(\.rs$|/)};
      # The stream itself produces `Received`, and its `call` is its own `collect`: only a
      # `collect` that loops over the stream itself (`mut self`) reads it by hand there.
      my $pattern = $is_client
        ? qr/fn collect\(mut self\)/
        : qr/Piece::(?:Record|Restarted|Failed)|Received::(?:Record|Restarted)|\breader\s*\.\s*next\(\)|\.collect\(\)\s*\.await/;
      while ($text =~ /$pattern/g) { $report->($-[0]); }
    }
  ' $(sources)
}

# Prints "lines file" for every production file over 900 lines (test files left out).
long_production_files() {
  sources | xargs wc -l | awk '$2 != "total" && $1 > 900 { print $1, $2 }' | sort -rn
}

# Prints "lines file" for every file over 900 lines.
long_files() {
  find schema/src services tests bench -name '*.rs' ! -path '*/target/*' -print0 \
    | xargs -0 wc -l | awk '$2 != "total" && $1 > 900 { print $1, $2 }' | sort -rn
}

# Prints "lines file:line fn-name" for every function over 120 lines; with "explained", those
# whose comments say why they are long, else the others.
long_functions() {
  local want=${1:-unexplained}
  WANT=$want perl -e '
    for my $f (@ARGV) {
      open(my $h, "<", $f) or next;
      my @lines = <$h>; close $h;
      my @open;  # [indent, name, first line]
      for my $i (0 .. $#lines) {
        my $l = $lines[$i];
        last if $l =~ /^#\[cfg\(test\)\]/ && ($lines[$i + 1] // "") =~ /^mod tests \{/;
        if ($l =~ /^([ \t]*)(?:pub(?:\([a-z]+\))? )?(?:const )?(?:async )?(?:unsafe )?fn ([A-Za-z_0-9]+)/) {
          my ($indent, $name) = (length($1), $2);
          # Its comments: the comment and attribute lines right above it.
          my $explained = 0;
          for (my $j = $i - 1; $j >= 0 && $lines[$j] =~ /^\s*(?:\/\/|#\[)/; $j--) {
            $explained = 1 if $lines[$j] =~ /Long because/;
          }
          # A declaration without a body (a trait method) ends on its own line.
          push @open, [ $indent, $name, $i + 1, $explained ] unless $l =~ /;\s*$/;
          next;
        }
        if (@open && $l =~ /^([ \t]*)\}/ && length($1) == $open[-1][0]) {
          my ($indent, $name, $from, $explained) = @{ pop @open };
          my $n = $i + 2 - $from;
          my $listed = $ENV{WANT} eq "explained" ? $explained : !$explained;
          printf "%d %s:%d %s\n", $n, $f, $from, $name if $n > 120 && $listed;
        }
      }
    }
  ' $(sources) | sort -rn
}

# Prints "file:line fn-name" for every public function of a library returning
# `Result<_, String>`.
string_errors() {
  perl -e '
    for my $f (@ARGV) {
      next if $f =~ m{services/cli/};
      open(my $h, "<", $f) or next;
      local $/; my $text = <$h>; close $h;
      $text =~ s/\n#\[cfg\(test\)\]\s*\nmod tests \{.*\z//s;
      while ($text =~ /^[ \t]*pub (?:async )?fn ([A-Za-z_0-9]+)[^{;]*?->\s*Result<[^{;]*,\s*String>\s*(?:where[^{;]*)?[{;]/mg) {
        my ($name, $at) = ($1, $-[0]);
        my $line = 1 + (() = substr($text, 0, $at) =~ /\n/g);
        print "$f:$line $name\n";
      }
    }
  ' $(sources)
}

section() {
  local title=$1 body=$2 count
  count=$(printf '%s' "$body" | grep -c . || true)
  printf '== %s: %s\n' "$title" "$count"
  [ -n "$body" ] && printf '%s\n' "$body" | sed 's/^/  /'
  return 0
}

hand=$(loops)
section "response streams read by hand outside the driver" "$hand"
section "files over 900 lines" "$(long_files)"
section "functions over 120 lines" "$(long_functions)"
section "functions over 120 lines, explained (\"Long because\")" "$(long_functions explained)"
section "public Result<_, String> in library crates" "$(string_errors)"

long_production=$(long_production_files)
section "production files over 900 lines" "$long_production"

if [ "$strict" = 1 ]; then
  bad=""
  [ -n "$hand" ] && bad="$bad; a response stream read by hand (read it with Reader::drive and an encoder)"
  [ -n "$long_production" ] && bad="$bad; a production file over 900 lines (split it by job)"
  [ -n "$(long_functions)" ] && bad="$bad; a function over 120 lines (split it, or say \"Long because\" and why above it)"
  [ -n "$(string_errors)" ] && bad="$bad; a public Result<_, String> in a library crate (give it an error type)"
  if [ -n "$bad" ]; then
    echo "shape:${bad#;} (see above)" >&2
    exit 1
  fi
fi
