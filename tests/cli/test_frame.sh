# asan
# The command frame: help, version, dispatch errors and exit codes.
. "$(dirname "$0")/lib.sh"

expect_exit help 0 "$K3" --help
expect_out_contains help "exit codes:"
expect_exit version 0 "$K3" --version
expect_out_contains version "k3 "
expect_exit no_args 2 "$K3"
expect_exit unknown_cmd 2 "$K3" frobnicate
expect_err_contains unknown_cmd "unknown command 'frobnicate'"
expect_exit help_unknown 2 "$K3" help frobnicate
expect_exit help_help 0 "$K3" help
# every listed command either has help or says it is not in this build
for c in $("$K3" --help | sed -n '/^commands:/,/^$/p' | awk 'NR>1 && NF {print $1}'); do
  if "$K3" --help | grep -E "^  $c " | grep -q "not in this build"; then
    expect_exit "help_$c" 2 "$K3" help "$c"
  else
    expect_exit "help_$c" 0 "$K3" help "$c"
    expect_exit "dashhelp_$c" 0 "$K3" "$c" --help
  fi
done
finish
