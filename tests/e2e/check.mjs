// check.mjs: the result lines every node test here prints, as tests/cli/lib.sh
// reads them: "PASS name" / "FAIL name: detail", then "N passed, N failed"
// (finish, which also sets the exit code).
let passed = 0, failed = 0;
export const check = (name, cond, detail = '') => {
  if (cond) { passed++; console.log(`PASS ${name}`); }
  else { failed++; console.log(`FAIL ${name}${detail ? ': ' + detail : ''}`); }
};
export const finish = () => {
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
};
