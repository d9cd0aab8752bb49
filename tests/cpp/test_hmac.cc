// SHA-256 and HMAC-SHA256 (libcrypto, behind common/hmac.h) against the standards' own test vectors
// (FIPS 180-2 examples, RFC 4231), and the constant-time comparison.
#include <string>

#include "common/hmac.h"
#include "harness.h"

using namespace fasthorovod;

namespace {

std::string Hex(const Digest& d) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : d) {
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

std::string Sha(const std::string& m) { return Hex(Sha256Of(m.data(), m.size())); }
std::string Hmac(const std::string& key, const std::string& m) {
  return Hex(HmacSha256(key.data(), key.size(), m.data(), m.size()));
}

}  // namespace

TEST(Sha256MatchesFips180Examples) {
  CHECK_EQ(Sha("abc"), std::string("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
  CHECK_EQ(Sha(""), std::string("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
  CHECK_EQ(Sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),  // two blocks
           std::string("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
  CHECK_EQ(Sha(std::string(1000000, 'a')),  // many blocks
           std::string("cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));
}

TEST(HmacSha256MatchesRfc4231) {
  CHECK_EQ(Hmac(std::string(20, '\x0b'), "Hi There"),
           std::string("b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"));
  CHECK_EQ(Hmac("Jefe", "what do ya want for nothing?"),
           std::string("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"));
  CHECK_EQ(Hmac(std::string(20, '\xaa'), std::string(50, '\xdd')),
           std::string("773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"));
  // Test case 6: a key longer than the block is hashed first.
  CHECK_EQ(Hmac(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First"),
           std::string("60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"));
  // Test case 7: a key and a message both longer than the block.
  CHECK_EQ(Hmac(std::string(131, '\xaa'),
                "This is a test using a larger than block-size key and a larger than block-size data. "
                "The key needs to be hashed before being used by the HMAC algorithm."),
           std::string("9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"));
  // A key of exactly one block is used as it is, not hashed (differs from its hash used as key).
  const std::string block_key(64, '\x42');
  const Digest hashed = Sha256Of(block_key.data(), block_key.size());
  CHECK(Hmac(block_key, "m") != Hmac(std::string(hashed.begin(), hashed.end()), "m"));
  // A key of 65 bytes is hashed first: the same MAC as under its hash.
  const std::string long_key(65, '\x42');
  const Digest long_hashed = Sha256Of(long_key.data(), long_key.size());
  CHECK_EQ(Hmac(long_key, "m"), Hmac(std::string(long_hashed.begin(), long_hashed.end()), "m"));
}

TEST(ConstantTimeEqualAndRandomBytes) {
  const char a[] = "0123456789abcdef", b[] = "0123456789abcdeX";
  CHECK(ConstantTimeEqual(a, a, 16));
  CHECK(!ConstantTimeEqual(a, b, 16));
  CHECK(ConstantTimeEqual(a, b, 15));
  CHECK(!ConstantTimeEqual("X123", "0123", 4));  // differing in the first byte as in the last
  CHECK(ConstantTimeEqual(a, b, 0));
  uint8_t x[16] = {}, y[16] = {};
  CHECK(RandomBytes(x, sizeof(x)));
  CHECK(RandomBytes(y, sizeof(y)));
  CHECK(!ConstantTimeEqual(x, y, sizeof(x)));
}
