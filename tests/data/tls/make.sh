#!/bin/sh
# Makes the throwaway test certificates of tests/tls.rs (run once; the output is committed).
# EC P-256 keys (PKCS#8), valid for 100 years. NOT secrets: never use them for anything real.
#   ca.pem          test CA: signs server.pem and client.pem
#   server.pem/key  server certificate for localhost, 127.0.0.1 and ::1 (serverAuth, and
#                   clientAuth: an instance offers it as its client identity when it
#                   forwards a query to another instance that requires client certificates)
#   client.pem/key  client certificate "taskstream-test-client" (clientAuth)
#   other-ca.pem    another CA, trusted by no one here; signs other-client.pem/key
set -eu
cd "$(dirname "$0")"
DAYS=36500
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }
ca() { # name, subject
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -sha256 -days $DAYS -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$1.pem"
}
leaf() { # name, subject, signing CA, extensions
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -sha256 -days $DAYS \
    -extfile "$1.ext" -out "$1.pem"
  rm "$1.csr" "$1.ext"
}
ca ca "taskstream test CA"
ca other-ca "taskstream other test CA"
leaf server localhost ca "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1"
leaf client taskstream-test-client ca "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
leaf other-client taskstream-other-client other-ca "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
# The CAs' keys are not needed by the tests.
rm -f ca.key other-ca.key ./*.srl
