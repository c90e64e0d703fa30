/*
 * asan_options.c: built into every program that may load cpu-onednn (the qkeep command, and
 * the test suites through tests/testutil.c); it only has an effect in an --enable-sanitizers build.
 *
 * Under AddressSanitizer (gcc 12's LeakSanitizer): at exit LSan walks every thread's dynamic
 * TLS, and on oneDNN's OpenMP worker threads it reads a garbage range ("DTLS 6 at
 * 0x000100000185-0x002500001287") and its tracer dies with SIGSEGV, so every process that ran
 * a oneDNN kernel would fail without a leak in sight. Not intercepting __tls_get_addr makes
 * LSan skip dynamic TLS; leaks are still checked everywhere else (ASAN_OPTIONS from the
 * environment add to this). The runtime looks this hook up in the executable.
 */
#if defined(__SANITIZE_ADDRESS__)
const char *__asan_default_options(void);
__attribute__((visibility("default"), used)) const char *__asan_default_options(void) {
  return "intercept_tls_get_addr=0";
}
#else
typedef int asan_options_unused; /* ISO C wants something in a translation unit */
#endif
