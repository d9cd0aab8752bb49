// Thin wrappers over libcrypto. The one-shot calls cannot fail for SHA-256 short of a broken or
// out-of-memory libcrypto; then the process stops rather than hand the handshake a MAC it did not
// compute (an all-zero expected MAC would be forgeable).
#include "common/hmac.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <climits>
#include <cstdio>
#include <cstdlib>

namespace fasthorovod {
namespace {

[[noreturn]] void CryptoFailed(const char* what) {
  std::fprintf(stderr, "fasthorovod: libcrypto %s failed\n", what);
  std::abort();
}

}  // namespace

Digest Sha256Of(const void* data, size_t len) {
  Digest out;
  unsigned int out_len = 0;
  if (EVP_Digest(data, len, out.data(), &out_len, EVP_sha256(), nullptr) != 1 || out_len != out.size()) {
    CryptoFailed("SHA-256");
  }
  return out;
}

Digest HmacSha256(const void* key, size_t key_len, const void* message, size_t message_len) {
  if (key_len > static_cast<size_t>(INT_MAX)) CryptoFailed("HMAC-SHA256 (key too long)");
  Digest out;
  unsigned int out_len = 0;
  // An empty key may come with a null pointer; HMAC() wants a valid one either way.
  static const uint8_t kEmpty = 0;
  const void* k = key_len == 0 ? &kEmpty : key;
  if (HMAC(EVP_sha256(), k, static_cast<int>(key_len), static_cast<const unsigned char*>(message), message_len,
           out.data(), &out_len) == nullptr ||
      out_len != out.size()) {
    CryptoFailed("HMAC-SHA256");
  }
  return out;
}

bool ConstantTimeEqual(const void* a, const void* b, size_t n) { return CRYPTO_memcmp(a, b, n) == 0; }

bool RandomBytes(void* out, size_t n) {
  uint8_t* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

}  // namespace fasthorovod
